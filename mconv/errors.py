class MconvError(Exception):
    """A problem with the user's input: the CLI prints the message as one line and exits non-zero."""
