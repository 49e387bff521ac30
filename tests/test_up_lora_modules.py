"""`kvgate up --lora-modules`: parsed, checked, and handed to every engine as vLLM's flags."""

from __future__ import annotations

import pytest

from kvgate.cli import build_parser
from kvgate.local import cli as up_cli
from kvgate.local.ports import plan_ports
from kvgate.local.stack import PoolConfig, StackConfig, engine_spec


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser(["up"], only_selected=True).parse_args(["up", *argv])


def test_modules_reach_every_engine_command_line() -> None:
    args = parse("--lora-modules", "a=/ad/a, b=/ad/b", "--lora-modules", "c=/ad/c")
    assert args.lora_modules == [("a", "/ad/a"), ("b", "/ad/b"), ("c", "/ad/c")]
    cfg = StackConfig(ports=plan_ports(0, 0, 2, 1), engines=2, lora_modules=tuple(args.lora_modules))
    for i in range(2):
        argv = list(engine_spec(cfg, i).argv)
        assert "--enable-lora" in argv
        given = [argv[j + 1] for j, a in enumerate(argv) if a == "--lora-modules"]
        assert given == ["a=/ad/a", "b=/ad/b", "c=/ad/c"]
    plain = StackConfig(ports=plan_ports(0, 0, 1, 1), engines=1)
    assert "--enable-lora" not in engine_spec(plain, 0).argv


@pytest.mark.parametrize("bad", ["a", "=/x", "a=", "a=/x,,b=/y"])
def test_malformed_modules_are_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("--lora-modules", bad)
    assert exc.value.code == 2
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_an_adapter_named_twice_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--port", "0", "--lora-modules", "a=/x", "--lora-modules", "a=/y")
    assert up_cli.run(args) == 2
    assert "more than once: a" in capsys.readouterr().err


def test_with_pools_each_adapter_reaches_only_its_pools_engines() -> None:
    args = parse(
        "--pool",
        "alpha=default:2",
        "--pool",
        "beta=default",
        "--lora-modules",
        "alpha/sql=/ad/sql,beta/chat=/ad/chat",
        "--lora-modules",
        "alpha/org/x=/ad/x",  # the adapter's own name may hold a slash: only the first one splits
    )
    adapters = up_cli.pool_lora_modules(["alpha", "beta"], args.lora_modules)
    assert adapters == {"alpha": [("sql", "/ad/sql"), ("org/x", "/ad/x")], "beta": [("chat", "/ad/chat")]}
    pools = (
        *(PoolConfig(name, model, n, tuple(adapters[name])) for name, model, n in args.pool),
        PoolConfig("gamma", "default", 1),
    )
    cfg = StackConfig(ports=plan_ports(0, 0, 4, 3), engines=4, epp_replicas=3, pools=pools)
    given = []
    for i in range(4):
        argv = list(engine_spec(cfg, i).argv)
        given.append(
            ("--enable-lora" in argv, [argv[j + 1] for j, a in enumerate(argv) if a == "--lora-modules"])
        )
    assert given == [
        (True, ["sql=/ad/sql", "org/x=/ad/x"]),
        (True, ["sql=/ad/sql", "org/x=/ad/x"]),
        (True, ["chat=/ad/chat"]),
        (False, []),  # a pool without adapters runs without --enable-lora
    ]


@pytest.mark.parametrize(
    "modules, message",
    [
        ("sql=/ad/sql", "with --pool each adapter names its pool, POOL/NAME=PATH (pools: alpha, beta)"),
        ("alpha/=/ad/sql", "POOL/NAME=PATH"),
        ("gamma/sql=/ad/sql", "no --pool is named 'gamma' (pools: alpha, beta)"),
        ("alpha/beta=/ad/sql", "'beta' is a pool's model name already"),
        ("alpha/sql=/a,alpha/sql=/b", "names adapter 'sql' twice"),
        ("alpha/sql=/a,beta/sql=/b", "adapter 'sql' in pools 'alpha' and 'beta'"),
    ],
)
def test_bad_pool_adapters_are_refused_before_anything_starts(
    modules: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(
        "--port", "0", "--pool", "alpha=default", "--pool", "beta=default", "--lora-modules", modules
    )
    assert up_cli.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate up: ") and message in err, err
    assert "Traceback" not in err
