"""Commands of this group register on `mklang.cli.app.app`."""

from mklang.cli.app import app  # noqa: F401
