"""The plugin's version, recorded in every manifest it writes (``plugin_version``)."""

__version__ = "0.1.0"
