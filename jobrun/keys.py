"""Key names -> signed 64-bit advisory lock ids, and their validation."""

from __future__ import annotations

import contextlib
import re
import unicodedata
from typing import TYPE_CHECKING, Any, NamedTuple

from jobrun.exitcodes import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

MAX_KEY_CHARS = 200
LOCK_ID_MIN = -(2**63)
LOCK_ID_MAX = 2**63 - 1
LOCK_ID_PREFIX = "lock-id:"


class Key(NamedTuple):
    """One lock: its numeric id (sort order) and the name it came from (None for ``--lock-id``).

    A NamedTuple rather than a dataclass: ``dataclasses`` pulls in ``inspect``, which would
    cost ``jobrun --help`` and ``jobrun key`` a third of their start-up time.
    """

    lock_id: int
    name: str | None = None

    @property
    def label(self) -> str:
        """The name a person knows the key by: the key name, or ``lock-id:N``."""
        return self.name if self.name is not None else f"{LOCK_ID_PREFIX}{self.lock_id}"

    @property
    def pg_locks_pair(self) -> tuple[int, int]:
        """``(classid, objid)`` as ``pg_locks`` shows a bigint advisory lock (objsubid 1)."""
        unsigned = self.lock_id & 0xFFFF_FFFF_FFFF_FFFF
        return unsigned >> 32, unsigned & 0xFFFF_FFFF


def lock_id_for(name: str) -> int:
    """Derive the lock id: the first 8 bytes of SHA-256(UTF-8 name), big-endian, signed.

    WARNING: this mapping is a public contract (it is in the README and pinned by test
    vectors); changing it would let old and new jobrun versions run the same job at once.
    """
    digest = _sha256()(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _sha256() -> Callable[[bytes], Any]:
    """SHA-256 from the interpreter's own module where it has one, else from hashlib.

    The same digest either way; ``hashlib`` loads OpenSSL first, a few milliseconds that
    ``jobrun key`` (a run imports psycopg, which loads it anyway) pays for nothing.
    """
    with contextlib.suppress(ImportError):
        from _sha2 import sha256  # type: ignore[import-not-found]  # noqa: PLC0415 - 3.12+

        return sha256  # type: ignore[no-any-return]
    with contextlib.suppress(ImportError):
        from _sha256 import sha256  # type: ignore[import-not-found]  # noqa: PLC0415 - 3.11

        return sha256  # type: ignore[no-any-return]
    import hashlib  # noqa: PLC0415 - OpenSSL's load: only where the interpreter has no own

    return hashlib.sha256


#: Unicode categories a key name may not contain: control (Cc), format (Cf: zero-width
#: spaces and joiners, bidi overrides such as U+202E), line and paragraph separators (Zl,
#: Zp), private use (Co), surrogates (Cs) and unassigned code points (Cn). Each is invisible
#: or renders differently from terminal to terminal, so two keys could look alike.
REFUSED_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "an invisible formatting character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
    "Co": "a private-use character",
    "Cs": "a surrogate",
    "Cn": "an unassigned code point",
}
#: Python decodes an argv byte that is not UTF-8 as one of these (surrogateescape).
_ESCAPED_BYTES = range(0xDC80, 0xDD00)


def validate_name(name: str) -> str:
    """Return ``name`` if it is a usable key name, else raise UsageError saying why.

    Refused, because two keys that look alike would be two different locks: characters of
    the REFUSED_CATEGORIES, whitespace at either end (or only whitespace), whitespace other
    than the ASCII space, and names not in Unicode NFC form (``é`` written as ``e`` plus a
    combining accent). Bytes that are not UTF-8 are refused as such.
    """
    if not name:
        raise UsageError("key name is empty")
    if len(name) > MAX_KEY_CHARS:
        raise UsageError(f"key name is {len(name)} characters long; the limit is {MAX_KEY_CHARS}")
    for position, char in enumerate(name):
        _check_char(char, position)
    if name.isspace():
        raise UsageError("key name is only whitespace")
    if name != name.strip():
        raise UsageError(f"key name {name!r} starts or ends with whitespace")
    if unicodedata.normalize("NFC", name) != name:
        raise UsageError(
            f"key name {name!r} is not in Unicode NFC form (a character and a combining "
            "accent where one precomposed character exists): it would look like another key"
        )
    # The history, status and --once-per know a run by its label: keys joined by commas,
    # a raw id as lock-id:N. A name that could be read as either would mix up two jobs.
    if "," in name:
        raise UsageError(f"key name {name!r} contains a comma (commas join several keys)")
    if name.startswith(LOCK_ID_PREFIX):
        raise UsageError(f"key name {name!r} starts with {LOCK_ID_PREFIX!r} (use --lock-id N)")
    return name


def _check_char(char: str, position: int) -> None:
    """Raise UsageError if ``char`` may not be part of a key name."""
    if ord(char) in _ESCAPED_BYTES:
        raise UsageError(
            f"key name is not valid UTF-8 (byte 0x{ord(char) - 0xDC00:02X} at position {position})"
        )
    category = unicodedata.category(char)
    if category in REFUSED_CATEGORIES:
        raise UsageError(
            f"key name contains {REFUSED_CATEGORIES[category]} (U+{ord(char):04X}) "
            f"at position {position}"
        )
    if char.isspace() and char != " ":
        raise UsageError(
            f"key name contains whitespace other than a plain space (U+{ord(char):04X}) "
            f"at position {position}"
        )


def validate_label(label: str) -> str:
    """Return ``label`` if it names a run as ``status`` prints it, else raise UsageError.

    A label is one or more parts joined by commas, each a key name or ``lock-id:N``.
    """
    for part in label.split(","):
        if part.startswith(LOCK_ID_PREFIX):
            parse_lock_id(part[len(LOCK_ID_PREFIX) :])
        else:
            validate_name(part)
    return label


def normalized_label(label: str) -> str:
    """``label`` validated and written as runs record it: its parts in locking order.

    A multi-key run is one label, comma-joined in ascending lock-id order: ``b,a`` names the
    same run as ``a,b``, whichever order the user wrote. Raises UsageError for a bad label.
    """
    validate_label(label)
    parts = label.split(",")
    names = tuple(part for part in parts if not part.startswith(LOCK_ID_PREFIX))
    lock_ids = tuple(
        part[len(LOCK_ID_PREFIX) :] for part in parts if part.startswith(LOCK_ID_PREFIX)
    )
    return describe(resolve(names, lock_ids))


def from_name(name: str) -> Key:
    """Build the Key for a validated name."""
    return Key(lock_id=lock_id_for(validate_name(name)), name=name)


def parse_lock_id(text: str) -> Key:
    """Build the Key for a raw ``--lock-id`` value (a signed 64-bit integer)."""
    digits = text.strip()
    # ASCII only: int() would also take "1_000" and non-Latin digits.
    if not re.fullmatch(r"[+-]?[0-9]+", digits):
        raise UsageError(f"--lock-id {text!r} is not an integer")
    value = int(digits, 10)
    if not LOCK_ID_MIN <= value <= LOCK_ID_MAX:
        raise UsageError(f"--lock-id {value} is outside the signed 64-bit range")
    return Key(lock_id=value)


def resolve(names: tuple[str, ...], lock_ids: tuple[str, ...]) -> tuple[Key, ...]:
    """All keys of a run, deduplicated and in ascending lock-id order (the locking order)."""
    keys = {from_name(name) for name in names} | {parse_lock_id(raw) for raw in lock_ids}
    if not keys:
        raise UsageError("no key given: use --key NAME (or --lock-id N, or JOBRUN_KEY)")
    by_id: dict[int, Key] = {}
    # Named keys first for each id, so a name wins over its own raw --lock-id.
    for key in sorted(keys, key=lambda k: (k.lock_id, k.name is None, k.name or "")):
        if key.lock_id in by_id:
            other = by_id[key.lock_id]
            if other.name is not None and key.name is not None:
                raise UsageError(
                    f"keys {other.label!r} and {key.label!r} map to the same lock id {key.lock_id}"
                )
            # A name and its own --lock-id: one lock; keep the name for the logs.
            by_id[key.lock_id] = other if other.name is not None else key
            continue
        by_id[key.lock_id] = key
    return tuple(by_id.values())


def describe(keys: tuple[Key, ...]) -> str:
    """Labels joined with commas, in locking order: the ``key`` field of every log line."""
    return ",".join(key.label for key in keys)


def names(keys: tuple[Key, ...]) -> list[str]:
    """What ``jobrun stop`` or ``pause`` may name to reach a run of ``keys``.

    The run's label, and each key's own: a pause of one key holds every run that takes it.
    """
    return list(dict.fromkeys([describe(keys), *(key.label for key in keys)]))


_LOCK_ID_LABEL = re.compile(r"lock-id:(-?\d+)")


def lock_ids_of(label: str) -> list[int]:
    """The lock ids of a key label the history does not know.

    Each comma-separated part (a multi-key run's label) is ``lock-id:N`` or a key name (key
    names cannot contain commas).
    """
    return [lock_id_of(part) for part in label.split(",")]


def lock_id_of(part: str) -> int:
    """The lock id of one key: ``lock-id:N`` or a key name."""
    match = _LOCK_ID_LABEL.fullmatch(part)
    if match:
        return int(match.group(1))
    return lock_id_for(part)
