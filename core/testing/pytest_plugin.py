"""The conformance kit as a pytest plugin: ``pytest --layerzoo-conformance`` adds one test per
architecture that an installed plugin registers a test config for (``-k conformance`` runs only
those; ``--layerzoo-conformance-plugins=a,b`` narrows them to some plugins;
``--layerzoo-conformance-no-graphs`` skips the captured-decode checks). A test fails listing
each false "supported" claim with its layer kind, check and first differing token.

Registered through the ``pytest11`` entry point of the ``layerzoo`` distribution.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("layerzoo")
    group.addoption("--layerzoo-conformance", action="store_true", default=False,
                    help="check every capability answer of the installed layerzoo plugins (conformance kit)")
    group.addoption("--layerzoo-conformance-plugins", default=None,
                    help="comma-separated plugin names to check (default: every installed plugin)")
    group.addoption("--layerzoo-conformance-no-graphs", action="store_true", default=False,
                    help="skip the captured-decode checks (on CPU they compile decode steps: minutes per architecture)")


class ConformanceItem(pytest.Item):
    """One architecture's test config, checked by the kit."""

    def __init__(self, *, test_config, **kwargs):
        super().__init__(**kwargs)
        self.test_config = test_config

    def runtest(self):
        import tempfile
        from pathlib import Path

        from layerzoo.testing.conformance import FAIL, check_test_config

        with tempfile.TemporaryDirectory(prefix="layerzoo-conformance-") as tmp:
            graphs = not self.config.getoption("--layerzoo-conformance-no-graphs")
            self.verdicts = check_test_config(self.test_config, Path(tmp), graphs=graphs)
        false = [v for v in self.verdicts if v.status == FAIL]
        if false:
            raise ConformanceFailure(false)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformanceFailure):
            return "false capability claims:\n" + "\n".join(v.describe() for v in excinfo.value.verdicts)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"conformance[{self.test_config.plugin}:{self.test_config.architecture}]"


class ConformanceFailure(Exception):
    def __init__(self, verdicts):
        super().__init__(f"{len(verdicts)} false claims")
        self.verdicts = verdicts


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--layerzoo-conformance"):
        return
    from layerzoo.testing.conformance import collect_test_configs

    names = config.getoption("--layerzoo-conformance-plugins")
    plugins = [n.strip() for n in names.split(",") if n.strip()] if names else None
    selected = []
    for tc in collect_test_configs(plugins=plugins):
        item = ConformanceItem.from_parent(session, name=f"conformance[{tc.plugin}:{tc.architecture}]", test_config=tc)
        selected.append(item)
    keyword = config.getoption("keyword")
    if keyword:  # -k applies to collected items before this hook; apply it to ours too
        from _pytest.mark import deselect_by_keyword

        deselect_by_keyword(selected, config)
    items.extend(selected)
