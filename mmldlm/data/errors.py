"""The one error type of the data pipeline. Its own module, free of heavy imports, so that the CLI
can catch it without importing torch."""


class DataError(ValueError):
    """Input or a prepared dataset that cannot be used; the message names the file and the line,
    field or value at fault and what was expected."""
