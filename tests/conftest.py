import pytest


@pytest.fixture(scope="session")
def testbed_target():
    """The converted SmolLM2-135M-Instruct folder (converted once per machine, then reused)."""
    from scripts.testbed import prepare_testbed_target

    return prepare_testbed_target()
