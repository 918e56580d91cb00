"""Errors a user can cause: the CLI prints them as one line and exits 1."""


class GraphoptError(Exception):
    """A problem with the user's input (file, model, option), not a bug in graphopt."""


class RewriteRejected(Exception):
    """A rewrite would break the graph; the engine rolls it back and reports the reason."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers, ``timeout`` and ``kill`` send): the command stops like on
    Ctrl-C, clean-up included, and exits with status 143 (128 + SIGTERM)."""
