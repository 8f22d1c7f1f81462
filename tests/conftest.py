"""Test-suite configuration: the real-service fixtures live in :mod:`tests.services`."""

pytest_plugins = ["tests.services", "tests.mqtt_support", "tests.fake_exporters", "tests.support"]
