"""pytest-only helpers: shared fixtures, history rows, session counts (servers: jobrun.testing)."""

#: The user_properties name under which a property test reports how many examples it tried.
EXAMPLES_PROPERTY = "hypothesis_examples"
