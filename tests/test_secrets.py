"""Passwords never reach a line, an error or a status output, and masking garbles nothing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrun import db, log
from support import jobrun_cli

UNREACHABLE = "host=127.0.0.1 port=1 user=u dbname=d"


def every_line(stderr: str) -> list[dict[str, object]]:
    """stderr's JSON event lines (a line that is not JSON fails the test)."""
    return jobrun_cli.events(
        "\n".join(line for line in stderr.splitlines() if line.startswith("{"))
    )


class TestUriPassword:
    """A password typed into a URI as it is, ``@`` included."""

    def test_raw_at_sign_is_a_usage_error_that_shows_no_part_of_it(self, key, tmp_path):
        """``u:p@wX@host``: exit 64, told to write %40, and neither ``p`` nor ``wX`` shown."""
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--", "touch", str(marker), dsn="postgresql://u:p@wXz9@127.0.0.1:1/db"
        )
        assert result.returncode == 64, result.stderr
        assert "%40" in result.stderr
        assert "wXz9" not in result.stderr
        assert "p@" not in result.stderr
        assert not marker.exists()

    def test_percent_encoded_password_is_masked_in_errors(self, key):
        """``p%40wXz9``: the server error names neither the password nor its pieces."""
        result = jobrun_cli.run(
            "--key", key, "--", "true", dsn="postgresql://u:p%40wXz9@127.0.0.1:1/db"
        )
        assert result.returncode == 69, result.stderr
        assert "wXz9" not in result.stderr
        assert "p%40" not in result.stderr


class TestShortPasswords:
    """A password of a few characters must not rewrite everything that contains them."""

    @pytest.mark.parametrize("password", ["e", "r", "ro", "err", "test"])
    def test_event_names_levels_and_keys_are_intact(self, dsn, password):
        """PGPASSWORD=e: ``started``, ``finished`` and ``"level": "error"`` read as written."""
        key = f"test-{password}-export"
        ran = jobrun_cli.run("--key", key, "--", "true", dsn=dsn, env={"PGPASSWORD": password})
        assert ran.returncode == 0, ran.stderr
        names = [line["event"] for line in every_line(ran.stderr)]
        assert names == ["started", "finished"]
        assert all(line["key"] == key for line in every_line(ran.stderr))
        failed = jobrun_cli.run(
            "--key", key, "--", "true", dsn=UNREACHABLE, env={"PGPASSWORD": password}
        )
        (line,) = every_line(failed.stderr)
        assert line["level"] == "error"
        assert line["event"] == "lockstore_unavailable"
        assert line["reason"] == "unreachable"
        assert line["key"] == key

    @pytest.mark.parametrize("password", ["e", "ab", "hunter2"])
    def test_quoted_in_an_error_it_is_masked(self, password):
        """An error quoting the password (as libpq quotes values) shows ``***`` instead."""
        target = db.Target(dsn=f"host=h password={password} port=1")
        text = db.one_line(Exception(f'bad value "{password}" for option'), target)
        assert f'"{password}"' not in text
        assert '"***"' in text


class TestDsnErrors:
    """A connection string that does not parse says what is wrong, minus the password."""

    def test_garbage_is_named(self, key):
        """``--dsn garbage``: the error quotes ``garbage``."""
        result = jobrun_cli.run("--key", key, "--", "true", dsn="garbage")
        assert result.returncode == 64
        assert '"garbage"' in result.stderr

    def test_password_in_a_bad_dsn_is_hidden(self, key):
        """An unterminated quote after the password: the error does not quote the password."""
        result = jobrun_cli.run("--key", key, "--", "true", dsn="host=h password=hunter2 port")
        assert result.returncode == 64
        assert "hunter2" not in result.stderr
        assert "connection string" in result.stderr


SECRET = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12
)


class TestMaskingProperties:
    """Whatever the password, the masking keeps its promises."""

    @given(secret=SECRET)
    def test_fixed_fields_never_change(self, secret):
        """``timestamp``, ``level`` and ``event`` are never rewritten."""
        redact = log.redactor([secret])
        event = {"level": "error", "event": "lockstore_unavailable", "timestamp": "x"}
        assert redact(None, "error", dict(event)) == event

    @given(secret=SECRET)
    def test_a_secret_standing_as_a_value_is_masked(self, secret):
        """Quoted (as libpq quotes values), or a whole field: the secret is masked."""
        masked = log.mask_secrets(f'bad value "{secret}" for option', [secret])
        assert f'"{secret}"' not in masked
        assert "***" in masked
        assert log.mask_secrets(secret, [secret]) == "***"

    @given(secret=st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=3))
    def test_short_secrets_leave_words_alone(self, secret):
        """A one-to-three letter password never changes a word it is part of."""
        words = ["started", "finished", "error", "warning", "skipped", "lockstore_unavailable"]
        for word in words:
            if word != secret:
                assert log.mask_secrets(word, [secret]) == word
                assert log.mask_secrets(f"the {word} line", [secret]) == f"the {word} line"

    def test_json_line_round_trips(self):
        """A masked line is still one JSON object."""
        text = log.mask_secrets('{"a": "hunter2"}', ["hunter2"])
        assert json.loads(text) == {"a": "***"}
