"""The one exception the decoder raises."""


class ProtocolError(ValueError):
    """A message could not be decoded: the text says what was wrong with it."""
