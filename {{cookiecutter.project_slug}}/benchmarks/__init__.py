"""The benchmarks, a package: run each from the project root with `python -m benchmarks.<name>` (`make bench`).

They import the project's package as installed (`make setup`), like the tests do.
"""
