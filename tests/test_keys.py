"""Key names map to lock ids by a fixed function that must never change silently."""

from __future__ import annotations

import uuid

import psycopg
import pytest

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
