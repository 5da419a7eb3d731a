"""The one exception type of megaft.data."""


class DataError(ValueError):
    """A data file or data setting is unusable; the message says where and how to fix it."""
