"""`python -m optim`: print the README's tables of optimizers and communication modes from the registries."""
from . import sync
from .registry import optimizers_table

print(optimizers_table())
print()
print(sync.markdown_table())
