"""The package version, in a module of its own so that any module can name it without
importing the public API in `mklang/__init__.py` (which imports the runtime when called)."""

__version__ = "2.0.0"
