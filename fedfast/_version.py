"""fedfast's version, in one place: ``fedfast.__version__``, ``fedfast --version``, setup.py (the package metadata),
run provenance and reports read it from here."""

__version__ = "0.1.0"
