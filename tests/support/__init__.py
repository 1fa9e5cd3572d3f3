"""Test helpers: private PostgreSQL servers, a fault-injecting TCP proxy and PgBouncer."""

#: The user_properties name under which a property test reports how many examples it tried.
EXAMPLES_PROPERTY = "hypothesis_examples"
