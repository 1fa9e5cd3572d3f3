"""Key names map to lock ids by a fixed function that must never change silently."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from harness import jobrun_cli
from jobrun import keys
from jobrun.exitcodes import UsageError
from jobrun.locks import new_run_id

#: Pinned: changing any of these lets two jobrun versions run one job at once.
VECTORS = [
    ("nightly-export", -5287385889299587548),
    ("a", -3848465438864589366),
    ("Zürich-backup", -6351849621260468089),
    ("日本語のジョブ", 4487149000739585170),
    ("emoji-🚀-deploy", 7600443751866551606),
    ("key with spaces", -3790903570498081916),
    ("x" * 200, -6187732315624340672),
]


class TestLockIds:
    """The name -> lock id function."""

    @pytest.mark.parametrize(("name", "lock_id"), VECTORS)
    def test_vectors_are_pinned(self, name, lock_id):
        """Each test vector maps to its recorded id."""
        assert keys.lock_id_for(name) == lock_id

    @pytest.mark.parametrize(("name", "lock_id"), VECTORS)
    def test_postgres_computes_the_same_id(self, dsn, name, lock_id):
        """An independent implementation in SQL agrees (first 8 bytes of SHA-256, signed)."""
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT ('x' || left(encode(sha256(convert_to(%s, 'UTF8')), 'hex'), 16))"
                "::bit(64)::bigint",
                (name,),
            ).fetchone()
        assert row is not None
        assert row[0] == lock_id

    def test_jobrun_schema_is_a_name_like_any_other(self):
        """The name jobrun:schema maps as every name does (older versions locked its id)."""
        assert keys.lock_id_for("jobrun:schema") == -1544725646478961277

    def test_pg_locks_pair_matches_what_postgres_shows(self, dsn):
        """classid/objid as printed by `jobrun key` are how pg_locks shows the lock."""
        key = keys.from_name("nightly-export")  # a negative id: classid is not 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (key.lock_id,))
            row = conn.execute(
                "SELECT classid::int8, objid::int8, objsubid FROM pg_locks "
                "WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            ).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", (key.lock_id,))
        assert row == (*key.pg_locks_pair, 1)


class TestValidation:
    """What counts as a key name or a raw lock id."""

    @pytest.mark.parametrize(
        "name", ["", "x" * 201, "tab\there", "new\nline", "nul\x00", "del\x7f", "c1\x85"]
    )
    def test_bad_names_are_refused(self, name):
        """Empty, over 200 characters, or with a control character."""
        with pytest.raises(UsageError):
            keys.from_name(name)

    @pytest.mark.parametrize("text", ["abc", "1.5", "9223372036854775808", "-9223372036854775809"])
    def test_bad_lock_ids_are_refused(self, text):
        """Not an integer, or outside the signed 64-bit range."""
        with pytest.raises(UsageError):
            keys.parse_lock_id(text)

    def test_keys_are_sorted_by_lock_id(self):
        """Several keys are taken in ascending lock-id order."""
        resolved = keys.resolve(("a", "日本語のジョブ", "nightly-export"), ("0",))
        assert [k.lock_id for k in resolved] == sorted(k.lock_id for k in resolved)

    def test_a_name_and_its_own_lock_id_are_one_lock(self):
        """--key x --lock-id <id of x> takes one lock, named x."""
        resolved = keys.resolve(("a",), (str(keys.lock_id_for("a")),))
        assert resolved == (keys.Key(lock_id=keys.lock_id_for("a"), name="a"),)


#: Names that look like another name, or like nothing at all.
LOOKALIKES = {
    "leading space": " a",
    "trailing space": "a ",
    "only spaces": "   ",
    "zero-width space": "a\u200bb",
    "zero-width joiner": "a\u200db",
    "byte order mark": "\ufeffa",
    "line separator": "a\u2028b",
    "paragraph separator": "a\u2029b",
    "right-to-left override": "a\u202eb",
    "no-break space": "a\u00a0b",
    "ideographic space": "a\u3000b",
    "private use": "a\ue000",
    "unassigned": "a\u0378",
    "combining accent (not NFC)": "e\u0301",
    "soft hyphen": "a\u00adb",
}


class TestLookalikes:
    """Invisible and ambiguous names are refused: two keys must not look alike."""

    @pytest.mark.parametrize("name", LOOKALIKES.values(), ids=LOOKALIKES.keys())
    def test_refused(self, name):
        """A usage error that says what is wrong."""
        with pytest.raises(UsageError):
            keys.validate_name(name)

    @pytest.mark.parametrize("name", ["a b", "Zürich-backup", "日本語のジョブ", "emoji-🚀-deploy"])
    def test_visible_names_are_accepted(self, name):
        """Inner plain spaces, accents (NFC), other scripts and emoji are fine."""
        assert keys.validate_name(name) == name

    def test_a_byte_that_is_not_utf8_is_said_to_be_so(self):
        """A non-UTF-8 argv byte (surrogateescape U+DCFF) is "not valid UTF-8", not a control."""
        name = b"job\xff".decode("utf-8", "surrogateescape")
        with pytest.raises(UsageError, match="not valid UTF-8") as caught:
            keys.validate_name(name)
        assert "0xFF" in str(caught.value)
        assert "control" not in str(caught.value)

    def test_non_utf8_key_on_the_command_line(self, jobrun_here):
        """The same through argv (as Python decodes it): exit 64 and "not valid UTF-8"."""
        result = jobrun_here.run("key", b"job\xff".decode("utf-8", "surrogateescape"), dsn=None)
        assert result.returncode == 64
        assert "not valid UTF-8" in result.stderr


class TestLabels:
    """`status` and `history` accept every label that `status` prints."""

    @pytest.mark.parametrize(
        "label", ["a", "a,b", "lock-id:1", "lock-id:1,lock-id:2", "a,lock-id:-5"]
    )
    def test_labels_are_accepted(self, label):
        """Key names and lock-id:N parts, joined by commas."""
        assert keys.validate_label(label) == label

    @pytest.mark.parametrize("label", ["", "a,", "lock-id:x", "lock-id:", " a"])
    def test_bad_labels_are_refused(self, label):
        """An empty part, a lock-id that is not a number, a bad name."""
        with pytest.raises(UsageError):
            keys.validate_label(label)

    @pytest.mark.parametrize("command", ["status", "history"])
    def test_lock_id_labels_on_the_command_line(self, dsn, command):
        """`jobrun status lock-id:1,lock-id:2` is accepted (it used to be refused)."""
        result = jobrun_cli.run(command, "lock-id:1,lock-id:2", dsn=dsn)
        assert result.returncode == 0, result.stderr

    @pytest.mark.parametrize(
        ("written", "recorded"),
        [("b,a", "a,b"), ("a,b", "a,b"), ("lock-id:+5,a", "a,lock-id:5"), ("a,a", "a")],
    )
    def test_labels_are_normalized_to_the_locking_order(self, written, recorded):
        """A label names the same run whichever order its parts are written in."""
        assert keys.normalized_label(written) == recorded

    def test_an_operator_reaches_a_run_by_its_label_or_any_of_its_keys(self):
        """`stop` and `pause` may name the run's label or one key's: each once, label first."""
        first, second = sorted(("x", "y"), key=keys.lock_id_for)
        run_keys = keys.resolve((second, first), ())
        assert keys.names(run_keys) == [f"{first},{second}", first, second]
        assert keys.names(keys.resolve(("x",), ())) == ["x"]

    def test_status_finds_a_multi_key_run_in_any_order(self, dsn, key):
        """`status 'b,a'` shows the run of --key a --key b, not an empty row."""
        first, second = sorted((f"{key}-1", f"{key}-2"), key=keys.lock_id_for)
        ran = jobrun_cli.run("--key", first, "--key", second, "--", "true", dsn=dsn)
        assert ran.returncode == 0, ran.stderr
        result = jobrun_cli.run("status", "--json", f"{second},{first}", dsn=dsn)
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)
        assert row["key"] == f"{first},{second}"
        assert row["last_outcome"] == "succeeded"


class TestRunIds:
    """Run ids are random version-4 UUIDs."""

    def test_run_ids_are_uuid4(self):
        """They parse as UUIDs of version 4 and differ each time."""
        ids = {new_run_id() for _ in range(1000)}
        assert len(ids) == 1000
        for text in list(ids)[:50]:
            parsed = uuid.UUID(text)
            assert parsed.version == 4
            assert str(parsed) == text
