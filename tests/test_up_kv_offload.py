"""`kvgate up --kv-offloading-size`: every engine gets the host KV tier (vLLM's flags)."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.cli import build_parser
from kvgate.local import cli as up_cli
from kvgate.local import stack as stack_module
from kvgate.local.stack import StackConfig, StackError, engine_spec


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser(["up"], only_selected=True).parse_args(["up", *argv])


def _configs(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, list[StackConfig]]:
    """What `kvgate up` would start, captured before anything starts."""
    seen: list[StackConfig] = []

    class Captured:
        def __init__(self, cfg: StackConfig, **_: Any) -> None:
            seen.append(cfg)

        def start(self, cancel: Any = None) -> None:
            raise StackError("captured")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(stack_module, "LocalStack", Captured)
    rc = up_cli.run(parse("--port", "0", "--base-port", "0", "--quiet", *argv))
    return rc, seen


def _engine_argvs(cfg: StackConfig) -> list[list[str]]:
    return [list(engine_spec(cfg, i).argv) for i in range(cfg.engines)]


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_the_tier_reaches_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgate.engine.cli import configure_parser  # the real engine CLI reads what up writes

    _, (cfg,) = _configs(
        monkeypatch, "--engines", "3", "--kv-offloading-size", "2.5", "--kv-offload-on", "compute"
    )
    argvs = _engine_argvs(cfg)
    assert len(argvs) == 3
    import argparse

    engine = argparse.ArgumentParser()
    configure_parser(engine)
    for argv in argvs:
        assert _flag(argv, "--kv-offloading-size") == "2.5"
        assert _flag(argv, "--kv-offload-on") == "compute"
        serve = argv[argv.index("serve") + 1 :]
        args = engine.parse_args(serve)
        assert (args.kv_offloading_size, args.kv_offload_on) == (2.5, "compute")


def test_no_tier_by_default_and_evict_is_left_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    _, (plain,) = _configs(monkeypatch)
    for argv in _engine_argvs(plain):
        assert "--kv-offloading-size" not in argv and "--kv-offload-on" not in argv
    _, (sized,) = _configs(monkeypatch, "--kv-offloading-size", "1")
    for argv in _engine_argvs(sized):
        assert _flag(argv, "--kv-offloading-size") == "1.0" and "--kv-offload-on" not in argv


def test_simulated_engines_get_the_sim_tier_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    _, (cfg,) = _configs(
        monkeypatch,
        "--simulate",
        "--sim-cpu-kv-blocks",
        "100",
        "--sim-kv-offload-bandwidth",
        "2e10",
        "--kv-offload-on",
        "compute",  # the sim tier alone is a tier
    )
    for argv in _engine_argvs(cfg):
        assert "--simulate" in argv
        assert _flag(argv, "--sim-cpu-kv-blocks") == "100"
        assert _flag(argv, "--sim-kv-offload-bandwidth") == "20000000000.0"
        assert _flag(argv, "--kv-offload-on") == "compute"


def test_prefill_and_decode_engines_both_get_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    _, (cfg,) = _configs(
        monkeypatch,
        "--simulate",
        "--prefill-engines",
        "1",
        "--decode-engines",
        "2",
        "--kv-offloading-size",
        "4",
    )
    argvs = _engine_argvs(cfg)
    assert len(argvs) == 3 and all(_flag(a, "--kv-offloading-size") == "4.0" for a in argvs)


def test_offload_on_without_a_tier_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, seen = _configs(monkeypatch, "--kv-offload-on", "compute")
    assert rc == 2 and not seen
    assert "--kv-offload-on needs a host KV tier" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-1", "lots"])
def test_a_bad_size_is_a_usage_error(bad: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("--kv-offloading-size", bad)
    assert exc.value.code == 2
