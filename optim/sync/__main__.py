"""`python -m optim.sync`: print the README's table of communication modes from the registry."""
from . import markdown_table

print(markdown_table())
