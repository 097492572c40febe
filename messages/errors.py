"""The one exception the decoder raises."""


class ProtocolError(ValueError):
    """A message could not be decoded: the text says what was wrong with it. version: the
    protocol version a message of another version carried (its peer runs another
    release), else None."""

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version
