"""The one error type of the data pipeline. Its own module, free of heavy imports, so that any
module can raise it without importing the pipeline."""

from mmldlm.errors import UserError


class DataError(UserError):
    """Input or a prepared dataset that cannot be used; the message names the file and the line,
    field or value at fault and what was expected."""
