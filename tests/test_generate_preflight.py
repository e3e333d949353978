"""Before generation, one GET proves the endpoint answers and accepts the key: a dead endpoint or a
rejected key fails in seconds, naming the endpoint and never the key, before any source is read or any
completion sent; an endpoint that serves no such GET is let through with a note. Real HTTP: the fault
server on 127.0.0.1, a port nothing listens on, and the `aerie` command."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from aerie.cli import main
from aerie.datasets import SourceSpec
from aerie.errors import EndpointAuthError, EndpointError, EndpointRequestError, EndpointUnreachableError
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.preflight import preflight_path
from aerie.generate.work import run
from aerie.store import LocalStore
from tests.fault_server import Fault, FaultServer
from tests.processes import free_port
from tests.stage_work import dataset_dir, generate_all

pytestmark = pytest.mark.integration  # HTTP servers on 127.0.0.1

KEY_ENV = "AERIE_TEST_PREFLIGHT_KEY"
SECRET = "sk-preflight-secret-value"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)


def source(tmp_path: Path, n: int = 3) -> Path:
    path = tmp_path / "source.jsonl"
    rows = ({"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(n))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(url: str, path: Path, names: tuple[str, ...] = ("toy",)) -> GenerateConfig:
    endpoint = EndpointConfig(base_url=url, api_key_env=KEY_ENV, concurrency=2, max_retries=0)
    specs = [
        DatasetSpec(
            name=n, source=SourceSpec(kind="jsonl", path=str(path)), sampling=SamplingParams(max_tokens=8)
        )
        for n in names
    ]
    return GenerateConfig(endpoint=endpoint, datasets=specs, max_failure_fraction=0.0)


def test_a_refused_connection_fails_naming_the_endpoint_before_the_source_is_read(tmp_path: Path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    cfg = config(url, tmp_path / "no-such-source.jsonl")  # read first, it would raise SourceNotFoundError
    with pytest.raises(EndpointUnreachableError, match="connection refused: nothing listens there") as err:
        run(cfg, cfg.datasets[0], dataset_dir(LocalStore(tmp_path / "store"), "r", cfg, cfg.datasets[0]))
    assert f"{url}/models" in str(err.value) and SECRET not in str(err.value)


def test_a_rejected_key_fails_before_any_completion_and_is_never_echoed(tmp_path: Path):
    with FaultServer(api_key="sk-the-right-one") as server:  # it echoes the key it was sent
        cfg = config(server.url, source(tmp_path))
        with pytest.raises(
            EndpointAuthError, match=f"rejected the API key in \\${KEY_ENV} \\(HTTP 401"
        ) as err:
            run(cfg, cfg.datasets[0], dataset_dir(LocalStore(tmp_path / "store"), "r", cfg, cfg.datasets[0]))
        assert server.url in str(err.value) and SECRET not in str(err.value)
        assert [g.prompt for g in server.gets] == ["/v1/models"]
        assert server.gets[0].authorization == f"Bearer {SECRET}"
        assert server.seen == []  # no completion was asked for


@pytest.mark.parametrize("code", [404, 405, 501])
def test_an_endpoint_without_the_check_is_let_through_with_a_note(
    code: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    with FaultServer(get_status=code) as server:
        cfg = config(server.url, source(tmp_path))
        with caplog.at_level(logging.WARNING, logger="aerie.generate.preflight"):
            result = run(
                cfg, cfg.datasets[0], dataset_dir(LocalStore(tmp_path / "store"), "r", cfg, cfg.datasets[0])
            )
        assert result.figures["records"] == 3 and len(server.gets) == 1
    assert f"answers HTTP {code} to GET: it serves no such check" in caplog.text


def test_other_answers_fail_with_their_status(tmp_path: Path):
    with FaultServer(get_status=400) as server:
        cfg = config(server.url, source(tmp_path))
        with pytest.raises(EndpointRequestError, match="answered HTTP 400 before any generation"):
            run(cfg, cfg.datasets[0], dataset_dir(LocalStore(tmp_path / "store"), "r", cfg, cfg.datasets[0]))
        assert len(server.gets) == 1 and server.seen == []
        server.get_status = 503  # busy: asked three times, then the run stops
        with pytest.raises(
            EndpointError, match="answered HTTP 503 before any generation \\(after 3 attempts"
        ):
            run(cfg, cfg.datasets[0], dataset_dir(LocalStore(tmp_path / "store"), "r", cfg, cfg.datasets[0]))
        assert len(server.gets) == 4 and server.seen == []


def test_several_datasets_check_the_endpoint_once(tmp_path: Path):
    with FaultServer() as server:
        cfg = config(server.url, source(tmp_path), names=("one", "two"))
        results = generate_all(cfg, LocalStore(tmp_path / "store"), "r")
        assert [r.figures["records"] for r in results] == [3, 3]
        assert len(server.gets) == 1


def test_the_check_is_the_key_listing_on_openrouter_and_models_elsewhere():
    assert preflight_path(EndpointConfig(), "https://openrouter.ai/api/v1") == "/key"
    assert preflight_path(EndpointConfig(), "http://127.0.0.1:30000/v1") == "/models"
    assert (
        preflight_path(EndpointConfig(preflight_path="/health"), "https://openrouter.ai/api/v1") == "/health"
    )


def test_the_aerie_command_exits_2_with_one_line_naming_the_endpoint(
    smollm2, tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    url = f"http://127.0.0.1:{free_port()}/v1"
    code = main(
        [
            "run",
            "smollm2-local",
            "--no-prefect",
            "--until",
            "generate",
            f"store.uri={tmp_path / 'store'}",
            f"generate.endpoint.base_url={url}",
            f"generate.endpoint.api_key_env={KEY_ENV}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"aerie: error: generation endpoint {url}/models: connection refused" in err
    assert SECRET not in err and "Traceback" not in err


# -- answers that are not an API's: a redirect, a login page, an event stream -------------------------

LOGIN_PAGE = f"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>token {SECRET} {'x' * 400}"


def _run_fails(cfg: GenerateConfig, tmp_path: Path, match: str) -> str:
    with pytest.raises(EndpointRequestError, match=match) as err:
        run(cfg, cfg.datasets[0], dataset_dir(LocalStore(tmp_path / "store"), "r", cfg, cfg.datasets[0]))
    assert SECRET not in str(err.value)
    return str(err.value)


def test_a_redirect_is_not_followed_and_named_as_one(tmp_path: Path):
    target = "https://gateway.example/v1/chat/completions?sig=secret-signature"
    with FaultServer(default=Fault(status=307, raw_body=b"", location=target)) as server:
        cfg = config(server.url, source(tmp_path))
        cfg.endpoint.max_retries = 3
        text = _run_fails(cfg, tmp_path, "answered HTTP 307, a redirect to https://gateway.example/v1/chat")
        assert "does not follow redirects" in text and "model name" not in text
        assert "secret-signature" not in text  # the query of a signed URL is not shown
        # A second prompt already in flight when the first failed may land a moment later; neither
        # is asked twice (not retried, not followed), whenever it lands.
        once = lambda: len(server.seen) == len({s.prompt for s in server.seen}) <= 2  # noqa: E731
        assert once()
        # The check before generation says the same of a redirected GET, and asks no prompt at all.
        server.get_fault = Fault(status=308, raw_body=b"", location="/api/v1/models")
        text = _run_fails(cfg, tmp_path, "answered HTTP 308, a redirect to http://127.0.0.1:")
        assert "/api/v1/models" in text and server.gets[-1].prompt.endswith("/models")
        assert once()


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        ("text/html; charset=utf-8", LOGIN_PAGE, "a login or proxy page"),
        ("text/event-stream", 'data: {"choices": [{"delta": {"content": "A"}}]}\n\n', "an event stream"),
    ],
)
def test_a_200_that_is_not_json_fails_at_once_with_its_type_and_start(
    tmp_path: Path, content_type: str, body: str, says: str
):
    page = Fault(raw_body=body.encode(), content_type=content_type)
    with FaultServer(default=page) as server:
        cfg = config(server.url, source(tmp_path))
        cfg.endpoint.max_retries = 5
        text = _run_fails(
            cfg, tmp_path, f"answered HTTP 200 with a body that is not JSON \\({content_type}\\)"
        )
        assert says in text
        begins = text.split("It begins: ", 1)[1]
        assert body.split()[0] in begins and len(begins) <= 200 + 2  # about 200 characters, quoted
        asked = len(server.seen)
        assert asked == len({s.prompt for s in server.seen}) <= 2  # each prompt once: never asked again
        assert "***" in text or content_type == "text/event-stream"  # the echoed key is redacted
        # A login page in front of the whole host answers the check before generation already.
        if "html" in content_type:
            server.get_fault = page
            _run_fails(cfg, tmp_path, "answered HTTP 200 with an HTML page \\(text/html")
            assert len(server.seen) == asked
