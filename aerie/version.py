"""aerie's version, in a module of its own so any module can read it without importing the package's
public names (`aerie/__init__.py` names them all)."""

__version__ = "0.1.0"
