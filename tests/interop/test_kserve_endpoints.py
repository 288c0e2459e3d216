"""Health and model readiness through oipgate as the kserve SDK's clients ask for them."""

import asyncio
import json

import pytest

from conftest import KINDS, PROTOCOLS, UPSTREAM, public_name


async def rest_checks(base: str, model: str):
    from kserve import InferenceRESTClient, RESTConfig

    async with InferenceRESTClient(RESTConfig(protocol="v2", retries=0)) as client:
        return (
            await client.is_server_live(base),
            await client.is_server_ready(base),
            await client.is_model_ready(base, model),
        )


async def grpc_checks(address: str, model: str):
    from kserve import InferenceGRPCClient

    async with InferenceGRPCClient(address) as client:
        return (await client.is_server_live(), await client.is_server_ready(), await client.is_model_ready(model))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", KINDS)
def test_kserve_clients_see_the_same_health(fleet, kind, protocol):
    upstream, _ = UPSTREAM[kind]["echo"]
    public = public_name(kind, protocol, "echo")
    backend = fleet.backends[kind]
    through = asyncio.run(rest_checks(f"http://{fleet.gateway.rest}", public))
    assert through == (True, True, True)
    if kind == "mlserver":
        # MLServer answers health checks with an empty body, which the kserve SDK's REST client cannot read; the
        # gateway answers with the protocol's JSON objects, which it can.
        with pytest.raises(json.JSONDecodeError):
            asyncio.run(rest_checks(f"http://{backend.rest}", upstream))
    else:
        assert asyncio.run(rest_checks(f"http://{backend.rest}", upstream)) == through
    assert asyncio.run(grpc_checks(fleet.gateway.grpc, public)) == asyncio.run(
        grpc_checks(backend.grpc, upstream)
    ) == (True, True, True)
