"""tessera: an inference cluster (vision encoder, decoder, pooling, adapter registry, gateway)."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed distribution's version ("unknown (not installed)" for a source tree run without installing)."""
    try:
        return version("tessera")
    except PackageNotFoundError:
        return "unknown (not installed)"
