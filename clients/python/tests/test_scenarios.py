"""The Rust replay harness's scenario files, replayed through the client against a real
gateway: on the embedded store, or two replicas on one Postgres database where the
scenario has two."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FencedDatabase, GatewayFactory
from scenarios import NOT_REPLAYED, Replay, load, scenario_files

REPLAYED = [path for path in scenario_files() if path.stem not in NOT_REPLAYED]


def test_every_scenario_file_is_replayed_or_listed_with_a_reason() -> None:
    """The files not replayed are exactly those that need what a client cannot stage, so
    a new file is replayed unless it is listed, and a listing cannot hide a file the
    replayer could run."""
    files = {path.stem: load(path) for path in scenario_files()}
    assert len(files) >= 10, f"the scenario files were not found: {sorted(files)}"
    for stem, scenario in files.items():
        assert scenario.name == stem, f"{stem}.toml is named {scenario.name!r}"
    not_staged = {stem for stem, scenario in files.items() if scenario.not_staged}
    assert set(NOT_REPLAYED) == not_staged, (
        f"listed as not replayed: {sorted(NOT_REPLAYED)}; needing what the replayer cannot stage: {sorted(not_staged)}"
    )


@pytest.mark.parametrize("path", REPLAYED, ids=[path.stem for path in REPLAYED])
def test_scenario(path: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    scenario = load(path)
    if scenario.replicas > 1:
        db: FencedDatabase = request.getfixturevalue("fenced_database")
        factory = GatewayFactory("postgres", db.admin_url)
    else:
        factory = GatewayFactory("embedded", str(tmp_path / "store"))
    try:
        gateways = [factory.start() for _ in range(scenario.replicas)]
        # Raises at the first step that differs, with the timeline up to it.
        Replay(scenario, gateways).run()
    finally:
        factory.stop_all()
