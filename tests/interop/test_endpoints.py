"""Health, server and model metadata, model readiness and the repository index through oipgate, as the clients'
own calls see them, compared with the servers answering directly."""

import pytest

from conftest import KINDS, PROTOCOLS, UPSTREAM, public_name


def triton(protocol: str, address: str):
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    return (triton_grpc if protocol == "grpc" else triton_http).InferenceServerClient(address)


def address(server, protocol: str) -> str:
    return server.grpc if protocol == "grpc" else server.rest


def metadata_dict(protocol: str, client, model: str, version: str = "") -> dict:
    if protocol == "grpc":
        return client.get_model_metadata(model, version, as_json=True)
    return client.get_model_metadata(model, version)


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
def test_server_health_and_metadata(fleet, client_protocol):
    client = triton(client_protocol, address(fleet.gateway, client_protocol))
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = (
        client.get_server_metadata(as_json=True) if client_protocol == "grpc" else client.get_server_metadata()
    )
    assert metadata["name"] == "oipgate"
    assert set(metadata["extensions"]) >= {"binary_tensor_data", "model_repository"}


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", KINDS)
def test_model_ready_and_metadata_match_the_server(fleet, kind, protocol, client_protocol):
    gateway = triton(client_protocol, address(fleet.gateway, client_protocol))
    direct = triton(client_protocol, address(fleet.backends[kind], client_protocol))
    for role, (upstream, version) in UPSTREAM[kind].items():
        public = public_name(kind, protocol, role)
        assert gateway.is_model_ready(public) == direct.is_model_ready(upstream, version) is True
        assert gateway.is_model_ready(public, "1")
        through = metadata_dict(client_protocol, gateway, public)
        straight = metadata_dict(client_protocol, direct, upstream, version)
        # One coherent model: the public name and the versions the gateway routes; the rest as the server says.
        assert through["name"] == public
        assert through["versions"] == ["1"]
        for key in ("platform", "inputs", "outputs"):
            assert through.get(key) == straight.get(key), key
    assert not gateway.is_model_ready("down")


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
def test_repository_index_lists_the_fleet(fleet, client_protocol):
    client = triton(client_protocol, address(fleet.gateway, client_protocol))
    index = client.get_model_repository_index(as_json=True) if client_protocol == "grpc" else (
        client.get_model_repository_index()
    )
    entries = index["models"] if client_protocol == "grpc" else index
    states = {e["name"]: e.get("state", "") for e in entries}
    expected = {public_name(k, p, r) for k in KINDS for p in PROTOCOLS for r in UPSTREAM[k]}
    assert set(states) == expected | {"down"}
    assert all(states[name] == "READY" for name in expected), states
    assert states["down"] == "UNAVAILABLE"
    reason = next(e.get("reason", "") for e in entries if e["name"] == "down")
    assert reason.startswith("backend down:"), reason


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", ["mlserver", "kserve"])
def test_statistics_of_a_backend_without_them_are_a_clear_501(fleet, kind, protocol, client_protocol):
    from tritonclient.utils import InferenceServerException

    client = triton(client_protocol, address(fleet.gateway, client_protocol))
    with pytest.raises(InferenceServerException) as refused:
        client.get_inference_statistics(public_name(kind, protocol, "echo"))
    status = str(refused.value.status())
    assert status in ("501", "StatusCode.UNIMPLEMENTED"), status
    assert f"backend {kind}-{protocol} keeps no model statistics" in refused.value.message()


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
def test_statistics_of_every_model_leave_out_backends_without_them(fleet, client_protocol):
    client = triton(client_protocol, address(fleet.gateway, client_protocol))
    answer = client.get_inference_statistics(as_json=True) if client_protocol == "grpc" else (
        client.get_inference_statistics()
    )
    names = {entry["name"] for entry in answer.get("model_stats", [])}
    assert names == {public_name("oipgate", p, r) for p in PROTOCOLS for r in UPSTREAM["oipgate"]}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", ["mlserver", "kserve"])
def test_model_configuration_of_a_backend_without_it_is_a_clear_501(fleet, kind, protocol):
    from tritonclient.utils import InferenceServerException

    client = triton(protocol, address(fleet.gateway, protocol))
    with pytest.raises(InferenceServerException) as refused:
        client.get_model_config(public_name(kind, protocol, "echo"))
    status = str(refused.value.status())
    assert status in ("501", "StatusCode.UNIMPLEMENTED"), status
    assert f"backend {kind}-{protocol} keeps no model configuration" in refused.value.message()


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
def test_the_extensions_announced_are_those_the_gateway_serves(fleet, client_protocol):
    client = triton(client_protocol, address(fleet.gateway, client_protocol))
    metadata = (
        client.get_server_metadata(as_json=True) if client_protocol == "grpc" else client.get_server_metadata()
    )
    assert metadata["extensions"] == [
        "binary_tensor_data",
        "sequence",
        "model_repository",
        "schedule_policy",
        "model_configuration",
        "statistics",
        "parameters",
        "generate",
    ]
    # Each one answers through the gateway, as the clients call it.
    public = public_name("oipgate", client_protocol, "echo")
    assert client.get_model_repository_index()
    assert client.get_inference_statistics(public)
    assert client.get_model_config(public)


@pytest.mark.parametrize("client_protocol", PROTOCOLS)
def test_shared_memory_calls_status_none_unregister_succeeds_register_says_why_not(fleet, client_protocol):
    from tritonclient.utils import InferenceServerException

    client = triton(client_protocol, address(fleet.gateway, client_protocol))
    system = client.get_system_shared_memory_status()
    cuda = client.get_cuda_shared_memory_status()
    if client_protocol == "grpc":
        assert not system.regions and not cuda.regions
    else:
        assert system == [] and cuda == []
    # A client's clean-up succeeds: there is nothing to unregister.
    client.unregister_system_shared_memory()
    client.unregister_system_shared_memory("region")
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("region")
    with pytest.raises(InferenceServerException) as refused:
        client.register_system_shared_memory("region", "/key", 64)
    assert "cannot be registered through a gateway" in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        client.register_cuda_shared_memory("region", b"\0" * 64, 0, 64)
    assert "cannot be registered through a gateway" in refused.value.message()
