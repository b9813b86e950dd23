"""The package's version (``[project] version`` in pyproject.toml), re-exported as ``hsd_opt.__version__``.

Recorded in what the package writes (a profile's ``provenance.hsd_opt_version``, a heads file's header), so it
lives at layer 0 where every module may import it.
"""

__version__ = "0.1.0"
