"""Errors a user can fix, and how the ``fastpar`` command shows them: one line, exit status 2.

Library code raises :class:`UserError` (or :class:`OptionError` for an option out of range) with a
message that says what is wrong and what to do. The command line maps those, and a few well-known
exceptions that are the user's to fix (a missing optional package, a path that can't be read or
written), to one line; everything else is a bug and keeps its traceback. ``fastpar --debug ...`` or
``FASTPAR_DEBUG=1`` shows the traceback of user errors too.

Every URL a message holds goes through :func:`redact_url` on its way to the user: a password or token
written into an endpoint or data URL is never printed, logged or stored.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator, Sequence

# OSErrors that mean "this path is wrong for what you asked", not "fastpar is broken".
_PATH_ERRORS = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError)


# "scheme://" then what follows up to whitespace, a quote or an angle bracket (URLs as messages quote them)
_URL_IN_TEXT = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s\"'<>]*)")
# Query parameters that carry secrets: presigned S3 URLs (X-Amz-Signature, X-Amz-Credential,
# X-Amz-Security-Token, AWSAccessKeyId, Signature), SAS tokens (sig), OAuth (access_token), passwords
_SECRET_PARAM = re.compile(r"sig|credential|token|secret|passw|pwd|key|auth", re.IGNORECASE)
_QUERY_PARAM = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")
REDACTED = "***"


def _redact_one(scheme: str, rest: str) -> str:
    query_at = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    head, tail = rest[:query_at], rest[query_at:]
    at = head.rfind("@")
    # userinfo (user:password@host) ends at the last "@" before the query. A password may hold an unescaped
    # "/" (AWS secret keys do), so a "/" before the "@" only means a path (a key such as "c/a@b.jpg") when
    # there is no ":" either
    if at >= 0 and (":" in head[:at] or "/" not in head[:at]):
        head = f"{REDACTED}@{head[at + 1 :]}"
    tail = _QUERY_PARAM.sub(lambda m: f"{m[1]}{m[2]}={REDACTED}" if _SECRET_PARAM.search(m[2]) else m[0], tail)
    return scheme + head + tail


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``: the userinfo
    (``http://user:pass@host`` -> ``http://***@host``) and secret query parameters (``?X-Amz-Signature=...``,
    ``token=``, ``sig=`` ...). Works on one URL or on a whole message; text without URLs is unchanged."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: _redact_one(m[1], m[2]), text)


class UserError(Exception):
    """A mistake the user can fix; ``str(exc)`` says what is wrong and what to do."""


class OptionError(UserError, ValueError):
    """An option value out of range. ``option`` is the option's name (``devices``); messages name it as
    ``TrainingOptions.devices``, which the command line rewrites to the flag the user typed (``--devices``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def _typed_flag(option: str, argv: Sequence[str]) -> str | None:
    flag = "--" + option.replace("_", "-")
    return flag if any(arg == flag or arg.startswith(flag + "=") for arg in argv) else None


def describe(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """The one line a user sees for ``exc``, or None when it is not a user error (show the traceback).

    ``argv`` is what the user typed after the command name: option errors are worded with its flags.
    """
    if isinstance(exc, UserError):
        text = str(exc)
        if isinstance(exc, OptionError) and (flag := _typed_flag(exc.option, argv)):
            text = re.sub(rf"\b\w*Options\.{exc.option}\b", flag, text)
    elif isinstance(exc, ImportError) and "pip install" in str(exc):  # fastpar._optional.require's message
        text = str(exc)
    elif isinstance(exc, _PATH_ERRORS) or (isinstance(exc, OSError) and exc.filename is not None):
        if exc.filename is None:  # fastpar's own wording, e.g. "TrainingOptions.checkpoint_dir=... is not ..."
            text = str(exc)
        else:
            text = f"{exc.filename}: {exc.strerror or exc}; check the path and that you may read and write there"
    else:
        return None
    return redact_url(" ".join(text.split()))  # one line, whatever the message held, no credentials


def _one_line_error(self: argparse.ArgumentParser, message: str):
    raise UserError(f"{message} (see '{self.prog} --help')")


@contextlib.contextmanager
def one_line_argparse_errors() -> Iterator[None]:
    """While active, a bad flag in any argparse parser raises UserError instead of printing the usage
    block and exiting, so every subcommand's flag errors read like its other errors. Parsers that
    define their own ``error()`` keep it."""
    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _one_line_error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]
