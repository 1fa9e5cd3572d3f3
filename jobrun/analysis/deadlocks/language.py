"""The server's messages in every language it ships, read back into PostgreSQL's English."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from jobrun.analysis.deadlocks.catalog import MESSAGES

_ENGLISH_SEVERITIES = frozenset(
    (
        "DEBUG1",
        "DEBUG2",
        "DEBUG3",
        "DEBUG4",
        "DEBUG5",
        "DEBUG",
        "INFO",
        "NOTICE",
        "WARNING",
        "ERROR",
        "LOG",
        "FATAL",
        "PANIC",
        "DETAIL",
        "HINT",
        "QUERY",
        "CONTEXT",
        "LOCATION",
        "STATEMENT",
    )
)
_LABELS = {
    "DETAIL:  ": "DETAIL",
    "HINT:  ": "HINT",
    "QUERY:  ": "QUERY",
    "CONTEXT:  ": "CONTEXT",
    "STATEMENT:  ": "STATEMENT",
    "LOCATION:  %s, %s:%d\n": "LOCATION",
    "LOCATION:  %s:%d\n": "LOCATION",
}


def _severity_words() -> dict[str, str]:
    words = {word: word for word in _ENGLISH_SEVERITIES}
    for word in ("DEBUG", "LOG", "INFO", "NOTICE", "WARNING", "ERROR", "FATAL", "PANIC"):
        for forms in MESSAGES[word].values():
            for form in forms:
                words.setdefault(form.strip(), word)
    for msgid, english in _LABELS.items():
        for forms in MESSAGES[msgid].values():
            for form in forms:
                label = form.split(":", 1)[0].strip()
                if label:
                    words.setdefault(label, english)
    return words


#: Every severity word (and label of the lines after a message) of every language -> English.
SEVERITY_WORDS: dict[str, str] = _severity_words()
#: The words not English: a log holding one was written with lc_messages in another language.
TRANSLATED_WORDS = frozenset(word for word in SEVERITY_WORDS if word not in _ENGLISH_SEVERITIES)
#: ``deadlock detected`` in every language.
DEADLOCK_TEXTS: tuple[str, ...] = (
    "deadlock detected",
    *sorted({form for forms in MESSAGES["deadlock detected"].values() for form in forms}),
)
_SPEC = re.compile(r"%(?:(\d+)\$)?[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|z)?([diouxXs%])")


@dataclass(frozen=True)
class _Form:
    """One wording of a message: its pattern, and which argument each group captures."""

    pattern: re.Pattern[str]
    order: tuple[int, ...]


def _literal(text: str) -> str:
    # A paste or a terminal may turn the server's spaces and tab-led line breaks into others.
    return r"\s+".join(re.escape(part) for part in re.split(r"\s+", text))


def _form(fmt: str, words: tuple[int, ...] = ()) -> _Form:
    """``fmt`` as a pattern; the arguments numbered in ``words`` are one word (a lock mode)."""
    parts: list[str] = []
    order: list[int] = []
    position = count = 0
    for spec in _SPEC.finditer(fmt):
        parts.append(_literal(fmt[position : spec.start()]))
        position = spec.end()
        if spec[2] == "%":
            parts.append("%")
            continue
        index = int(spec[1]) - 1 if spec[1] else count
        order.append(index)
        count += 1
        if spec[2] in "diouxX":
            parts.append(r"(-?\d+)")
        else:
            # WARNING: one free argument per pattern at most: two lazy runs split by a word
            # (" on ") would try every split of a crafted line, in time growing with its
            # square. The lock mode is one word.
            parts.append(r"(\S+?)" if index in words else r"(.*?)")
    parts.append(_literal(fmt[position:]))
    return _Form(re.compile(r"\s*" + "".join(parts) + r"\s*\Z", re.DOTALL), tuple(order))


@functools.cache
def _forms(msgid: str) -> tuple[_Form, ...]:
    translated = {form for forms in MESSAGES.get(msgid, {}).values() for form in forms}
    words = (1,) if " on %s" in msgid else ()  # the lock mode, before the lock's tag
    return (_form(msgid, words), *(_form(form, words) for form in sorted(translated)))


@functools.cache
def _template(msgid: str) -> str:
    count = 0

    def number(spec: re.Match[str]) -> str:
        nonlocal count
        if spec[2] == "%":
            return "%"
        count += 1
        return "{" + str(count - 1) + "}"

    return _SPEC.sub(number, msgid.replace("{", "{{").replace("}", "}}"))


#: The longest text read as one of the messages here: theirs are short, and a pattern with
#: two lazy arguments tried on a crafted long line would take time growing with its square.
LONGEST = 2048


def arguments(msgid: str, text: str) -> list[str] | None:
    """The arguments of ``msgid`` (in its order) when ``text`` is it in some language."""
    if len(text) > LONGEST:
        return None
    for form in _forms(msgid):
        match = form.pattern.match(text)
        if match is not None:
            values = [""] * len(form.order)
            for group, index in enumerate(form.order, start=1):
                if index < len(values):
                    values[index] = match[group]
            return values
    return None


def english(msgid: str, text: str) -> str | None:
    """``text`` in PostgreSQL's English when it is ``msgid`` in some language, else None."""
    values = arguments(msgid, text)
    return None if values is None else _template(msgid).format(*values)


#: What a lock is on, as DescribeLockTag words it.
LOCK_TAGS = (
    "relation %u of database %u",
    "extension of relation %u of database %u",
    "pg_database.datfrozenxid of database %u",
    "page %u of relation %u of database %u",
    "tuple (%u,%u) of relation %u of database %u",
    "transaction %u",
    "virtual transaction %d/%u",
    "speculative token %u of transaction %u",
    "object %u of class %u of database %u",
    "user lock [%u,%u,%u]",
    "advisory lock [%u,%u,%u,%u]",
    "remote transaction %u of subscription %u of database %u",
    "unrecognized locktag type %d",
)
#: The CONTEXT of a wait for a row (XactLockTableWaitErrorCb), and of an SPI query.
CONTEXTS = (
    'while updating tuple (%u,%u) in relation "%s"',
    'while deleting tuple (%u,%u) in relation "%s"',
    'while locking tuple (%u,%u) in relation "%s"',
    'while locking updated version (%u,%u) of tuple in relation "%s"',
    'while inserting index tuple (%u,%u) in relation "%s"',
    'while checking uniqueness of tuple (%u,%u) in relation "%s"',
    'while rechecking updated tuple (%u,%u) in relation "%s"',
    'while checking exclusion constraint on tuple (%u,%u) in relation "%s"',
    'SQL statement "%s"',
)
_WAITS = "Process %d waits for %s on %s; blocked by process %d."
_RUNS = "Process %d: %s"
#: Lock waits logged with log_lock_waits, by what happened.
LOCK_WAITS = {
    "still waiting": "process %d still waiting for %s on %s after %ld.%03d ms",
    "detected deadlock": (
        "process %d detected deadlock while waiting for %s on %s after %ld.%03d ms"
    ),
    "acquired": "process %d acquired %s on %s after %ld.%03d ms",
    "avoided deadlock": (
        "process %d avoided deadlock for %s on %s by rearranging queue order after %ld.%03d ms"
    ),
}


def lock_tag(text: str) -> str:
    """What a lock is on, in English (as logged when no wording fits)."""
    if text.startswith(("transaction ", "relation ", "tuple (", "advisory lock [")):
        return text  # English, as most servers write it: no need to try the others
    for msgid in LOCK_TAGS:
        found = english(msgid, text)
        if found is not None:
            return found
    return text


def context(text: str) -> str:
    """A CONTEXT's first line in English when it is a lock wait's or a query's."""
    first, newline, rest = text.partition("\n")
    if first.startswith(("while ", "SQL statement")):
        return text
    for msgid in CONTEXTS:
        found = english(msgid, first)
        if found is not None:
            return found + newline + rest
    return text


def detail(text: str) -> str:
    """A deadlock DETAIL with each ``Process N ...`` line in English (statements untouched)."""
    out: list[str] = []
    for line in text.split("\n"):
        waits = arguments(_WAITS, line)
        if waits is not None:
            out.append(_template(_WAITS).format(*waits[:2], lock_tag(waits[2]), waits[3]))
            continue
        if not line.lstrip().startswith("Process "):
            runs = arguments(_RUNS, line.rstrip() + (" " if line.rstrip()[-1:] == ":" else ""))
            if runs is not None:
                out.append(f"Process {runs[0]}: {runs[1]}".rstrip())
                continue
        out.append(line)
    return "\n".join(out)


def _first_words() -> frozenset[str]:
    starts = set()
    for msgid in LOCK_WAITS.values():
        for form in (msgid, *(f for forms in MESSAGES[msgid].values() for f in forms)):
            starts.add(form[:1] if form[:1] != "%" else "0123456789")
    return frozenset("".join(starts))


#: First characters of every lock wait's wording: a message starting otherwise is none.
LOCK_WAIT_FIRST = _first_words()


@dataclass
class LockWait:
    """A lock wait logged with log_lock_waits: who waited for what, held by whom."""

    line: int
    pid: int
    what: str
    lock: str
    holders: list[int]
    statement: str | None = None
    context: str | None = None


def lock_wait(message: str) -> tuple[str, int, str] | None:
    """(what happened, pid, ``Mode on tag``) of a lock wait message in any language."""
    if message[:1] not in LOCK_WAIT_FIRST:
        return None
    for what, msgid in LOCK_WAITS.items():
        values = arguments(msgid, message)
        if values is not None:
            return what, int(values[0]), f"{values[1]} on {lock_tag(values[2])}"
    return None


_HOLDERS = re.compile(r"Process(?:es)? holding the lock: (?P<pids>[\d, ]+)\.")


def holders(detail_text: str) -> list[int]:
    """The pids holding the lock, from a lock wait's DETAIL (PostgreSQL never translates it)."""
    match = _HOLDERS.search(detail_text)
    if match is None:
        return []
    return [int(pid) for pid in re.findall(r"\d+", match["pids"])]


#: Characters of a text searched for a deadlock's wording: the error, the cycle's lines and
#: the detection come first in their message; a statement after them may run to megabytes.
WORDING_WINDOW = 4096


def _wording_pattern() -> re.Pattern[str]:
    texts = [re.escape(text) for text in DEADLOCK_TEXTS]
    # WARNING: an argument is matched within a bounded run of one line, never ``.*?``: on
    # a crafted line repeating the words, a lazy run to the end at each would be quadratic.
    texts.extend(
        form.pattern.pattern.removeprefix(r"\s*")
        .removesuffix(r"\s*\Z")
        .replace("(.*?)", r"[^\n]{0,200}?")
        .replace(r"\s+", r"\s{1,8}")
        for msgid in (_WAITS, LOCK_WAITS["detected deadlock"])
        for form in _forms(msgid)
    )
    return re.compile("|".join(texts))


_DEADLOCK_WORDING = _wording_pattern()


def has_deadlock_wording(text: str) -> bool:
    """Whether ``text`` (its first WORDING_WINDOW characters) holds a deadlock's wording."""
    return _DEADLOCK_WORDING.search(text, 0, WORDING_WINDOW) is not None


#: What %a, %u and %d show (in the server's language) before a session is named.
UNNAMED = frozenset(
    {"", "[unknown]", *(f for forms in MESSAGES["[unknown]"].values() for f in forms)}
)


def _authorized() -> tuple[frozenset[str], tuple[re.Pattern[str], ...]]:
    """log_connections' ``connection authorized`` line in each language, its name captured."""
    languages = sorted({lang for by in MESSAGES.values() for lang in by})

    def start(msgid: str, lang: str) -> str:
        return MESSAGES[msgid].get(lang, (msgid,))[0].split("%", 1)[0]

    patterns = {}
    for lang in [None, *languages]:
        head = start("connection authorized: user=%s", lang) if lang else "connection authorized: "
        app = start(" application_name=%s", lang) if lang else " application_name="
        ends = [
            start(msgid, lang) if lang else msgid.split("%", 1)[0]
            for msgid in (
                " SSL enabled (protocol=%s, cipher=%s, bits=%d)",
                " GSS (authenticated=%s, encrypted=%s)",
            )
        ]
        ends = [re.escape(end.split("(")[0].rstrip() or end) for end in ends]
        patterns[head, app] = re.compile(
            rf"{re.escape(head)}.*?{re.escape(app)}(?P<app>.*?)(?:{'|'.join(ends)}|\Z)", re.DOTALL
        )
    return frozenset(head[:1] for head, _ in patterns), tuple(patterns.values())


#: First characters of log_connections' line in every language.
AUTHORIZED_FIRST, _AUTHORIZED = _authorized()


def authorized_app(message: str) -> str | None:
    """The application_name a ``connection authorized`` line (any language) gives, if any."""
    if message[:1] not in AUTHORIZED_FIRST:
        return None
    for pattern in _AUTHORIZED:
        match = pattern.match(message)
        if match is not None:
            return match["app"]
    return None
