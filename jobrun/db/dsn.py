"""Connection strings: parse and check a DSN, mask its passwords, name its target safely."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import psycopg
from psycopg import conninfo

from jobrun.exitcodes import UsageError
from jobrun.log import safe_text
from jobrun.masking import forms, mask_text

if TYPE_CHECKING:
    from collections.abc import Callable

_URI_PREFIXES = ("postgresql://", "postgres://")
#: Any URI's scheme (``postgresql+psycopg``, ``jdbc:postgresql``): safe to name in an error.
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*(?::[A-Za-z][A-Za-z0-9+.-]*)*(?=://)"
#: libpq's hosts of a URI: ``host[:port]`` (IPv6 in brackets), comma-separated.
_URI_HOSTS = r"(?:\[[^\]]*\]|[^:,\[\]]*)(?::[0-9]*)?(?:,(?:\[[^\]]*\]|[^:,\[\]]*)(?::[0-9]*)?)*"
# Used on error paths only: a plain string, compiled (and cached by ``re``) when needed.
_QUOTED = r'"[^"]*"'

#: The sslmode a connection over a network gets when nothing says how to protect it: TLS
#: or no connection, so that no password crosses the network in the clear (libpq's own
#: default, ``prefer``, goes on in plain text when the server, or a man in the middle,
#: declines TLS, and then sends a cleartext password if asked for one).
NETWORK_SSLMODE = "require"
#: Parameters (connection string, else environment) by which the user has said how the
#: connection is to be encrypted or authenticated; with any of them, libpq's rules stand.
#: A service's section may set sslmode, and jobrun cannot read it as libpq does: a named
#: service is the user's choice too.
_TLS_CHOICES = (
    ("sslmode", "PGSSLMODE"),
    ("requiressl", "PGREQUIRESSL"),
    ("require_auth", "PGREQUIREAUTH"),
    ("service", "PGSERVICE"),
)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Mask passwords in ``text``: URI userinfo, ``password=`` pairs, and known secrets.

    Known secrets are masked where they stand as a value (quoted, after ``=`` or ``:``,
    before ``@``), never inside other words: a one-letter password must not garble text.
    """
    return mask_text(text, secrets)


@dataclass(frozen=True)
class Target:
    """Where and how to connect: a DSN (or libpq defaults) plus jobrun's session settings."""

    #: Never in the repr: it may hold the password.
    dsn: str = field(default="", repr=False)
    connect_timeout: float = 10.0
    #: Seconds of unacknowledged sends after which the kernel drops the connection.
    tcp_user_timeout: float = 10.0
    #: What this process learned about the server path (a pooler refusing ``options``).
    _learned: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    #: Called once per attempt that has had no answer for SLOW_CONNECT seconds (a server
    #: that accepts and never answers would otherwise mean --connect-timeout of silence).
    on_slow_connect: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The DSN's password (and PGPASSWORD), in every form an error may quote: never shown."""
        passwords = [str(parse_dsn(self.dsn).get("password") or ""), *_uri_passwords(self.dsn)]
        passwords.append(os.environ.get("PGPASSWORD", ""))
        # Also URL-encoded: a job that builds its own URI from them prints them that way.
        return tuple(dict.fromkeys(form for secret in passwords for form in forms(secret)))

    @property
    def has_password(self) -> bool:
        """Whether the DSN itself carries a password (visible in ``ps`` when given as a flag)."""
        return bool(parse_dsn(self.dsn).get("password")) or bool(_uri_passwords(self.dsn))


def _uri_passwords(dsn: str) -> list[str]:
    """The password of a URI as typed (and each piece of it around a raw ``@``).

    Any scheme: a driver-qualified ``postgresql+psycopg://`` is refused, but its password
    must not show in the meantime. The userinfo ends where libpq ends it, at the last
    ``@`` before the first ``/``.
    """
    if re.match(_SCHEME, dsn) is None:
        return []
    authority = dsn.split("://", 1)[1].split("/", 1)[0]
    userinfo, at, _ = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return []
    raw = userinfo.split(":", 1)[1]
    pieces = [raw, unquote(raw), *raw.split("@")]
    return [piece for piece in dict.fromkeys(pieces) if piece]


def parse_dsn(dsn: str) -> dict[str, Any]:
    """The DSN's parameters, or UsageError (with passwords masked) when it does not parse."""
    if safe_text(dsn) != dsn:
        raise UsageError(
            "--dsn/JOBRUN_DSN contains bytes that are not UTF-8 (check the locale or the file "
            "it came from)"
        )
    _check_uri(dsn)
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        # WARNING: libpq quotes the part it could not parse, and that may be the password.
        detail = redact(" ".join(str(exc).split()), tuple(_uri_passwords(dsn)))
        detail = re.sub(_QUOTED, lambda m: _quoted_fragment(m.group(0), dsn), detail)
        raise UsageError(f"--dsn/JOBRUN_DSN is not a valid connection string: {detail}") from None
    if dsn.startswith(_URI_PREFIXES) and "@" in str(params.get("host") or ""):
        raise UsageError(
            "--dsn/JOBRUN_DSN: the URI has more than one '@' before the host; an '@' inside "
            "the user name or password must be written %40"
        )
    _check_values(params, dsn)
    return params


#: Values libpq accepts for its keyword options (as of libpq 18), checked before any
#: connection: psycopg resolves host names before libpq sees the string, so a typo here
#: would otherwise read as an unreachable server (exit 69), which ``--on-db-error run``
#: runs unguarded. A value libpq accepts is never refused.
_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
    "ssl_min_protocol_version": ("", "TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "ssl_max_protocol_version": ("", "TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
}
#: Of those, the ones libpq compares without regard to case.
_ANY_CASE = ("ssl_min_protocol_version", "ssl_max_protocol_version")
#: Options libpq reads as integers (jobrun sets some of them itself, but a typo in one is
#: still a typo the user should hear of).
_INTEGERS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
#: Where libpq looks when the connection string does not set an option.
_VARIABLES = {
    "port": "PGPORT",
    "hostaddr": "PGHOSTADDR",
    "sslmode": "PGSSLMODE",
    "gssencmode": "PGGSSENCMODE",
    "channel_binding": "PGCHANNELBINDING",
    "sslcertmode": "PGSSLCERTMODE",
    "sslnegotiation": "PGSSLNEGOTIATION",
    "target_session_attrs": "PGTARGETSESSIONATTRS",
    "load_balance_hosts": "PGLOADBALANCEHOSTS",
    "ssl_min_protocol_version": "PGSSLMINPROTOCOLVERSION",
    "ssl_max_protocol_version": "PGSSLMAXPROTOCOLVERSION",
    "connect_timeout": "PGCONNECT_TIMEOUT",
}
#: libpq's parse_int_param: an optional sign, digits, surrounding blanks.
_INTEGER = r"\s*[-+]?\d+\s*"
_MAX_PORT = 65535


def _check_values(params: dict[str, Any], dsn: str) -> None:
    """UsageError for a value libpq would refuse (the DSN's, else its PG* variable's).

    One line, the value shown with passwords masked: a port, an integer option, a
    numeric host address, or one of a fixed set of words.
    """
    env = os.environ
    for name in ("port", "hostaddr", *_CHOICES, *_INTEGERS):
        where = "--dsn/JOBRUN_DSN"
        value = params.get(name)
        variable = _VARIABLES.get(name)
        if value is None and variable is not None and variable in env:
            where, value = variable, env[variable]
        if value is None:
            continue
        problem = _problem(name, str(value))
        if problem is not None:
            secrets = (str(params.get("password") or ""), *_uri_passwords(dsn))
            secrets += (env.get("PGPASSWORD", ""),)
            shown = redact(safe_text(problem), tuple(s for s in secrets if s))
            raise UsageError(f"{where}: {shown} (libpq would refuse it before connecting)")


def _problem(name: str, value: str) -> str | None:
    """What libpq would say is wrong with ``name=value`` (None: it would take it)."""
    if name == "port":
        bad = [port for port in value.split(",") if port.strip() and not _is_port(port)]
        return f'invalid port "{bad[0]}": a number from 1 to {_MAX_PORT}' if bad else None
    if name == "hostaddr":
        bad = [addr for addr in value.split(",") if addr.strip() and not _is_address(addr)]
        return (
            f'invalid hostaddr "{bad[0]}": a numeric IP address (host= takes a name)'
            if bad
            else None
        )
    if name in _INTEGERS:
        return None if re.fullmatch(_INTEGER, value) else f'invalid {name} "{value}": an integer'
    choices = _CHOICES[name]
    found = value.lower() if name in _ANY_CASE else value
    if found in (choice.lower() if name in _ANY_CASE else choice for choice in choices):
        return None
    return f'invalid {name} "{value}": one of {", ".join(c for c in choices if c)}'


def _is_port(text: str) -> bool:
    return bool(re.fullmatch(_INTEGER, text)) and 1 <= int(text) <= _MAX_PORT


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip())
    except ValueError:
        return False
    return True


def _check_uri(dsn: str) -> None:
    """UsageError for a URI libpq would misread or not take; the message shows no part of it.

    Driver-qualified URIs (SQLAlchemy's ``postgresql+psycopg://``, JDBC's
    ``jdbc:postgresql://``) are refused rather than rewritten: their query parameters are
    the driver's, not libpq's, and a guess could connect somewhere else than meant.
    """
    scheme = re.match(_SCHEME, dsn)
    if scheme is None:
        return
    if not dsn.startswith(_URI_PREFIXES):
        name = scheme.group(0)
        if "postgres" not in name.lower():
            raise UsageError(
                f"--dsn/JOBRUN_DSN: a {name}:// URI is not a PostgreSQL connection string "
                "(postgresql://... or host=... dbname=...)"
            )
        raise UsageError(
            f"--dsn/JOBRUN_DSN: {name}:// is a driver's URL, not libpq's: write it "
            "postgresql://... (as psql takes it), without the driver's query parameters"
        )
    rest = dsn.split("://", 1)[1]
    hosts, slash, path = rest.partition("/")
    if "@" in hosts or not slash:
        return
    database = path.split("?", 1)[0]
    if "@" in database or ("@" in path and re.fullmatch(_URI_HOSTS, hosts) is None):
        # libpq ends the user name and password at the first "/": it would take the
        # password for a port and the rest for the database name, and show them.
        raise UsageError(
            "--dsn/JOBRUN_DSN: the URI has an '@' after a '/': a '/' inside the user name "
            "or password must be written %2F (and an '@' in a database name %40)"
        )


def _quoted_fragment(quoted: str, dsn: str) -> str:
    """A fragment libpq quoted from the DSN: kept unless it could hold the password."""
    fragment = quoted[1:-1]
    risky = "password" in dsn.lower() or bool(_uri_passwords(dsn))
    if risky and fragment and fragment not in ("=", "'") and not _is_keyword(fragment):
        return '"***"'
    return quoted


def _is_keyword(word: str) -> bool:
    return bool(re.fullmatch(r"[a-z_]+", word)) and word != "password"


def describe(target: Target) -> str:
    """``host:port/dbname`` as far as the DSN says: safe to log (no user, no password)."""
    params = parse_dsn(target.dsn)
    env = os.environ
    service = params.get("service") or env.get("PGSERVICE")
    if service and not (params.get("host") or params.get("hostaddr")):
        # The address is in a service file: say which service, rather than guess a socket.
        return redact(safe_text(f"service {service}"), target.secrets)
    # As libpq resolves them: the DSN, then the PG* variables, then its built-in defaults.
    host = params.get("host") or params.get("hostaddr") or env.get("PGHOST") or "local socket"
    port = params.get("port") or env.get("PGPORT") or "5432"
    dbname = (
        params.get("dbname")
        or env.get("PGDATABASE")
        or params.get("user")
        or env.get("PGUSER")
        or "(default database)"
    )
    return redact(safe_text(f"{host}:{port}/{dbname}"), target.secrets)


def network_sslmode(params: dict[str, Any]) -> str | None:
    """``require`` when the connection goes over a network and nothing says how to protect it.

    None when the user chose (sslmode, require_auth, a service, ``channel_binding=require``,
    ``gssencmode=require``, ``sslrootcert=system``, in the connection string or the
    environment) or when every
    address it may reach is local: a Unix-domain socket, ``localhost`` or a loopback address.
    """
    env = os.environ
    if any(params.get(key) or env.get(var) for key, var in _TLS_CHOICES):
        return None
    if str(params.get("gssencmode") or env.get("PGGSSENCMODE", "")) == "require":
        return None  # encrypted by GSSAPI, or no connection at all
    if str(params.get("channel_binding") or env.get("PGCHANNELBINDING", "")) == "require":
        return None  # SCRAM bound to TLS, or no authentication at all
    if str(params.get("sslrootcert") or env.get("PGSSLROOTCERT", "")) == "system":
        return None  # libpq makes that sslmode=verify-full
    hosts = str(params.get("host") or env.get("PGHOST", "")).split(",")
    addrs = str(params.get("hostaddr") or env.get("PGHOSTADDR", "")).split(",")
    # libpq pairs the lists entry by entry, and connects to hostaddr where one is given.
    for index in range(max(len(hosts), len(addrs))):
        host = hosts[index] if index < len(hosts) else hosts[0]
        addr = addrs[index] if index < len(addrs) else ""
        if not _is_local(addr.strip() or host.strip()):
            return NETWORK_SSLMODE
    return None


def _is_local(address: str) -> bool:
    """Whether libpq reaches ``address`` without a network: a socket, or the loopback."""
    if not address or address.startswith(("/", "@")):  # a Unix-domain socket (or abstract)
        return True
    if address.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # any other name: wherever the resolver says, so a network
        return False
