"""What counts as a secret of a run, and masking it out of what jobrun stores, sends or prints."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import quote, quote_plus, unquote

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

#: jobrun's own variables that can carry a secret: the connection string (its password),
#: the ping URL and the ping base (credentials themselves: whoever has one can ping the
#: check, or every check of the project's ping key) and the alert command (often a webhook
#: URL with its token). The child and the hook never get them, unless ``--pass-env`` names
#: them.
WITHHELD = ("JOBRUN_DSN", "JOBRUN_PING", "JOBRUN_PING_BASE", "JOBRUN_ON_ALERT")
#: The variables jobrun sets for the child. An inherited value (from a jobrun further up,
#: or a stale export) is removed first: the child sees only what this run set.
SET_FOR_CHILD = (
    "JOBRUN_KEY",
    "JOBRUN_LOCK_ID",
    "JOBRUN_RUN_ID",
    "JOBRUN_FENCE_TOKEN",
    "JOBRUN_SLOT",
)

#: A variable named like this holds a secret (case-insensitive): its value is masked in
#: kept output, ping bodies and the alert hook's event.
_HIDDEN_NAME = r"(?i)PASSWORD|PASSWD|PASSPHRASE|SECRET|TOKEN|CREDENTIAL|_KEY$"
#: ... unless it names where a secret is kept rather than the secret (``AWS_..._FILE``), or
#: is jobrun's own (``JOBRUN_KEY`` is a key name; the DSN and ping URL are read apart).
_PLAIN_NAME = r"(?i)^JOBRUN_|_(?:FILE|PATH|DIR)$"
#: A value guessed to be secret from its variable's name is masked only from this length:
#: ``TOKEN_ENABLED=1`` or ``USE_SECRETS=yes`` would otherwise mask every ``1`` and ``yes``.
#: Variables named with ``--mask-env`` are masked whatever their length.
MIN_GUESSED = 6

# The userinfo of a URI of any scheme (``postgresql+psycopg://``, ``https://``): the
# password runs to the *last* ``@`` of the word, whatever it holds (``/``, ``@``, ``:``,
# ``%xx``, non-ASCII). Masking a little too much beats showing a piece of a password.
_MASK_URI = r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/?#@]*:)\S*@"
_MASK_KEYWORD = r"(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)"


#: A secret shorter than this is masked only where it is plainly a value (quoted, after
#: ``=``); a longer one also where it stands alone between spaces or punctuation.
_SHORT_SECRET = 4
#: A secret this long is masked wherever it occurs, even glued to other text (a hook that
#: prints it inside a word): no word of a log line contains it by chance.
_LONG_SECRET = 8
_BEFORE = "\\s\"'=:@/(<\\["
_AFTER = "\\s\"'@/),;:>\\]"


def mask_secrets(text: str, secrets: Iterable[str]) -> str:
    """Mask each secret where it occurs as a value in ``text``, not inside other words.

    A password ``e`` must not turn ``started`` into ``start***d``, nor ``test`` rewrite a
    key named ``test-export``: a secret of 4 to 7 characters is masked only when nothing
    but a delimiter (space, quote, ``=``, ``:``, ``@``, ``/``, brackets) surrounds it, a
    shorter one only when quoted or after ``=``; one of 8 or more wherever it occurs.
    """
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        if text == secret:
            return "***"
        if secret not in text:
            continue
        if len(secret) >= _LONG_SECRET:
            text = text.replace(secret, "***")
            continue
        escaped = re.escape(secret)
        if len(secret) < _SHORT_SECRET:
            pattern = rf"(?:(?<=[\"'])|(?<==)){escaped}(?=[\"'@\s]|$)"
        else:
            pattern = rf"(?:(?<=[{_BEFORE}])|^){escaped}(?=[{_AFTER}]|$)"
        text = re.sub(pattern, "***", text)
    return text


def passed_on(environ: Mapping[str, str], pass_env: Iterable[str] = ()) -> dict[str, str]:
    """``environ`` without jobrun's secret-bearing variables, but for those in ``pass_env``."""
    kept = set(pass_env)
    return {name: value for name, value in environ.items() if name not in WITHHELD or name in kept}


def forms(secret: str) -> tuple[str, ...]:
    """A secret as a program may print it: as is, and URL-encoded (``%2F``, ``+``)."""
    if not secret:
        return ()
    return tuple(dict.fromkeys((secret, quote(secret, safe=""), quote(secret), quote_plus(secret))))


#: A segment of a ping URL's path this long is a key (a UUID, a Healthchecks ping key).
_PATH_KEY = 16


def url_secrets(url: str | None) -> tuple[str, ...]:
    """The secret parts of an http(s) URL: the URL itself, its password and its path.

    The path counts: a Healthchecks URL's check key is in it, and is masked on its own too.
    """
    if not url:
        return ()
    rest = url.split("://", 1)[-1]
    authority, _, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    found = [url, rest]
    if at and ":" in userinfo:
        password = userinfo.split(":", 1)[1]
        found += [*forms(password), *forms(unquote(password))]
    path = path.split("?", 1)[0].strip("/")
    if path:
        found += [f"{host}/{path}", path]
        # A check key or UUID on its own (a slug such as "nightly" is not a secret).
        found += [part for part in path.split("/") if len(part) >= _PATH_KEY]
    return tuple(found)


def named_secrets(
    environ: Mapping[str, str], mask_env: Iterable[str] = (), *, guess: bool = True
) -> tuple[str, ...]:
    """Values of the variables in ``mask_env``, and (``guess``) of those named like secrets."""
    named = set(mask_env)
    found: list[str] = []
    for name, value in environ.items():
        if name in named:
            found += forms(value)
        elif (
            guess
            and len(value) >= MIN_GUESSED
            and re.search(_HIDDEN_NAME, name)
            and not re.search(_PLAIN_NAME, name)
        ):
            found += forms(value)
            # A key file's text (PEM) may be printed a line at a time.
            found += [line for line in value.splitlines() if len(line) >= MIN_GUESSED]
    return tuple(found)


#: Every form of each password this process connected with (see ``learn``), for every
#: mask_text: the kept tails, the pings, the alert hook's input and jobrun's own lines.
_learned: tuple[str, ...] = ()
#: The (user, password) pairs already learned: a reconnect costs one lookup.
_seen: set[tuple[str, str]] = set()


def learn(password: str | None, user: str | None = None) -> None:
    """Mask ``password`` (as the connection's ``user`` sent it) from now on, in this process.

    Called with the password libpq used for a connection (PQpass): the DSN's, PGPASSWORD,
    a service file's or one from the password file, whichever it took. Nothing is kept
    before the run's first connection, so every tail is masked with it.
    """
    global _learned  # noqa: PLW0603 - one run per process: its passwords are the process's
    if not password or (user or "", password) in _seen:
        return
    _seen.add((user or "", password))
    _learned = tuple(dict.fromkeys((*_learned, *password_forms(password, user or ""))))


def password_forms(password: str, user: str = "") -> tuple[str, ...]:
    """A password as a job may print it: as is, URL-encoded, and in base64.

    Base64 of the password alone and of ``user:password`` (an HTTP ``Basic`` header), with
    and without its ``=`` padding, in the standard and the URL-safe alphabet. Only these
    standalone encodings: inside a longer base64 text the password's encoding depends on
    where it starts, and is not masked.
    """
    if not password:
        return ()
    # binascii, not base64: a C module, nothing more for the run path to import.
    import binascii  # noqa: PLC0415 - only once a password is known

    found = list(forms(password))
    for plain in (password, f"{user}:{password}" if user else ""):
        if not plain:
            continue
        encoded = binascii.b2a_base64(plain.encode("utf-8", "surrogateescape"), newline=False)
        for variant in (encoded, encoded.translate(_URLSAFE)):
            text = variant.decode("ascii")
            found += [text, text.rstrip("=")]
    return tuple(dict.fromkeys(found))


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def password_file_secrets(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Every password of the password file libpq reads (PGPASSFILE, else ~/.pgpass), in every form.

    All of its lines, not only the one this run's connection matches: a run whose database
    is down never learns which one libpq took (its child may still run, with
    ``--on-db-error run``), and a job may connect elsewhere with another line. Read only
    when libpq would read it: a plain file that neither group nor others may access.
    """
    import os  # noqa: PLC0415 - loaded by the interpreter already
    import stat  # noqa: PLC0415 - loaded with os
    from pathlib import Path  # noqa: PLC0415 - only runs that keep output or alert

    named = environ.get("PGPASSFILE")
    path = Path(named) if named else Path(environ.get("HOME") or "~") / ".pgpass"
    try:
        # WARNING: O_NONBLOCK, or a FIFO planted there holds the run up; the checks are
        # made on what was opened, not on the name (which may change in between).
        fd = os.open(path.expanduser(), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode) or mode & (stat.S_IRWXG | stat.S_IRWXO):
                return ()
            text = file.read(_PASSWORD_FILE_LIMIT).decode("utf-8", "surrogateescape")
    except OSError:
        # Unreadable: libpq cannot use it either. Never said: its name is all we could say.
        return ()
    found: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        fields = _password_file_fields(line)
        if len(fields) == 5:  # noqa: PLR2004 - host:port:database:user:password
            user = fields[3] if fields[3] != "*" else ""
            found += password_forms(fields[4], user)
    return tuple(dict.fromkeys(found))


#: A password file is a few lines; more than this is not one libpq users write by hand.
_PASSWORD_FILE_LIMIT = 1024 * 1024


def _password_file_fields(line: str) -> list[str]:
    """A password file's line as libpq splits it: ``:`` ends a field, ``\\`` escapes one character.

    The password is the fifth field, up to the next unescaped ``:`` (libpq ignores the rest).
    """
    fields, current, escaped = [], [], False
    for char in line:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ":":
            fields.append("".join(current))
            current = []
            if len(fields) == 5:  # noqa: PLR2004 - the password ended
                return fields
        else:
            current.append(char)
    if escaped:  # a backslash at the end stands for itself
        current.append("\\")
    fields.append("".join(current))
    return fields


def mask_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URI passwords, ``password=`` values and ``secrets`` masked as ``***``.

    So are the passwords this process connected with (``learn``), wherever text is masked.
    """
    if "://" in text:
        text = re.sub(_MASK_URI, r"\1***@", text)
    if "=" in text:
        text = re.sub(_MASK_KEYWORD, r"\1***", text)
    return mask_secrets(text, (*secrets, *_learned) if _learned else secrets)


class Masker:
    """Masks one run's secrets out of text and bytes (kept output, pings, the alert hook)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = tuple(dict.fromkeys(secret for secret in secrets if secret))

    def text(self, text: str) -> str:
        """``text`` masked (see mask_text)."""
        return mask_text(text, self.secrets)

    def data(self, data: bytes, *, cut: bool = False) -> bytes:
        """Bytes masked as text; ``cut``: they are the end of a longer stream.

        Bytes that are not UTF-8 pass through unchanged (surrogateescape both ways). A
        stream cut short may begin inside a secret: a start that is the end of a secret
        is masked too, so its second half never shows.
        """
        if not data:
            return data
        text = self.text(data.decode("utf-8", "surrogateescape"))
        if cut:
            text = self._mask_leading_part(text)
        return text.encode("utf-8", "surrogateescape")

    def _mask_leading_part(self, text: str) -> str:
        longest = 0
        for secret in (*self.secrets, *_learned):
            for start in range(1, len(secret)):
                tail = secret[start:]
                if len(tail) > longest and text.startswith(tail):
                    longest = len(tail)
                    break
        return "***" + text[longest:] if longest else text
