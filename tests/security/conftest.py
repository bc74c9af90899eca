"""The adversarial suite runs the real Serve ingress apps in this process (no Ray Serve): the
replica context it stands in and the instance it hangs on an app must not outlive a test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _serve_apps_left_as_imported():
    import ray.serve.context

    from lmfoundry.agents import api as agents_api
    from lmfoundry.align import review_api
    from lmfoundry.serving import api as serving_api

    context = ray.serve.context._INTERNAL_REPLICA_CONTEXT
    yield
    ray.serve.context._INTERNAL_REPLICA_CONTEXT = context
    for module in (serving_api, agents_api, review_api):
        if hasattr(module.app.state, "replica"):
            del module.app.state.replica
