"""Who may talk to the server: the API key (any case of 'Bearer'), the docs behind it, the Host check."""

import pytest

from orca_jax import serve
from orca_jax.server.app import LOCAL_HOSTS, create_app
from orca_jax.server.middleware import host_name

from tests.helpers.server import FakeEngine, asgi_client

pytestmark = pytest.mark.anyio


BODY = {"prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize("header, status", [
    ("Bearer k3y", 200), ("bearer k3y", 200), ("BEARER k3y", 200), ("Bearer  k3y ", 200),
    ("Bearer K3Y", 401), ("Basic k3y", 401), ("k3y", 401), ("Bearer", 401), ("Bearerk3y", 401), ("", 401),
])
async def test_the_bearer_scheme_is_case_insensitive_the_key_is_not(header, status):
    async with asgi_client(create_app(FakeEngine(), api_key="k3y")) as client:
        response = await client.post("/v1/completions", json=BODY, headers={"Authorization": header})
    assert response.status_code == status, response.text


async def test_docs_and_schema_need_the_key_when_one_is_set():
    async with asgi_client(create_app(FakeEngine(), api_key="k")) as client:
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert (await client.get(path)).status_code == 401, path
            assert (await client.get(path, headers={"Authorization": "Bearer k"})).status_code == 200, path
        assert (await client.get("/health")).status_code == 200
    async with asgi_client(create_app(FakeEngine())) as client:  # no key: open, as before
        assert (await client.get("/openapi.json")).status_code == 200


@pytest.mark.parametrize("host, status", [
    ("localhost:8000", 200), ("127.0.0.1:8000", 200), ("[::1]:8000", 200), ("LOCALHOST", 200),
    ("my.box:8000", 200), ("evil.example:8000", 400), ("localhost.evil.example", 400), ("", 400),
])
async def test_host_header_must_name_an_allowed_host(host, status):
    app = create_app(FakeEngine(), allowed_hosts=LOCAL_HOSTS + ("my.box",))
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json=BODY, headers={"Host": host})
        health = await client.get("/health", headers={"Host": host})
    assert response.status_code == health.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["code"] == "invalid_host"


async def test_no_host_check_unless_asked():
    async with asgi_client(create_app(FakeEngine())) as client:
        response = await client.post("/v1/completions", json=BODY, headers={"Host": "anything.example"})
    assert response.status_code == 200


def test_host_name_strips_the_port():
    assert host_name(b"Example.COM:80") == "example.com"
    assert host_name(b"[::1]:8000") == "[::1]" and host_name(b"[::1]") == "[::1]"
    assert host_name(b"localhost") == "localhost"


@pytest.mark.parametrize("argv, expected", [
    ([], LOCAL_HOSTS + ("127.0.0.1",)),
    (["--allowed-hosts", "a.example, b.example"], LOCAL_HOSTS + ("127.0.0.1", "a.example", "b.example")),
    (["--host", "0.0.0.0"], None),
    (["--host", "0.0.0.0", "--allowed-hosts", "a.example"], ("a.example",)),
    (["--allowed-hosts", "*"], None),
])
def test_serve_flags_choose_the_allowed_hosts(argv, expected):
    assert serve.allowed_hosts_from_args(serve.build_parser().parse_args(argv)) == expected


def test_serve_flags_for_text_and_defaults():
    args = serve.build_parser().parse_args([])
    assert args.default_max_tokens == 256 and args.allow_special_tokens_in_text is False
    with pytest.raises(SystemExit):
        serve.main(["--default-max-tokens", "-1"])
