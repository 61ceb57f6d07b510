"""Benchmarks that drive the public APIs: comm microbenchmarks (bench.comm), step-time breakdown."""


def require(module: str, extra: str = "bench") -> None:
    """Import `module`, an optional dependency, or fail with the line that installs it."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{module} is not installed; it is an optional dependency of lioncub-train: "
                          f"pip install -e '.[{extra}]' (or pip install {module})") from None
