"""A session that finishes (``ServiceClient.close``) frees its clients' adapters in the trainer
and its snapshot samplers in the engine; its run records and checkpoints stay usable."""

from __future__ import annotations

from typing import Any

from tinker_testing import API_KEY, BASE


def test_a_finished_session_frees_its_adapters_and_keeps_its_checkpoints(server: Any) -> None:
    import httpx
    import tinker

    srv = server.running.server
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result(
        timeout=60)
    client.save_weights_and_get_sampling_client().result(timeout=60)
    path = client.save_state("kept").result(timeout=60).path
    loaded = len(srv.sampler.engine.lora_adapters)
    assert client.model_id in srv.trainer.adapters
    service.close("success").result(timeout=60)

    assert client.model_id not in srv.trainer.adapters
    assert len(srv.sampler.engine.lora_adapters) == loaded - 1
    r = httpx.post(server.url + "/api/v1/optim_step", headers={"X-API-Key": API_KEY},
                   json={"model_id": client.model_id, "adam_params": {"learning_rate": 0.1}})
    assert r.status_code == 410 and "released" in r.json()["error"]

    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result(
        timeout=30).checkpoints] == [path]
    again = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    resumed = again.create_training_client_from_state(path).result(timeout=60)
    assert resumed.get_info().lora_rank == 4
    again.close("success").result(timeout=60)
