"""Every dashboard and alert expression, evaluated by a real Prometheus that scraped a real executor.

The executor serves a few steps on every path (eager, eager_no_copy, full_graph, piecewise,
a graph fallback, logprobs, a refused batch); Prometheus scrapes it on loopback with the
alert rules loaded. Every expression must evaluate without error, every metric name it uses
must exist in the scrape, and every rule must evaluate healthily: a renamed metric breaks
this test, not a dashboard in production.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.service.runtime_config import RuntimeConfigUpdate
from tests.prometheus_tools import PrometheusBinaries, running_prometheus
from tests.promql_sources import RULES, all_queries, metric_names
from tests.server_util import running_server, tiny_config

JOB = "model-executor"  # the job name the rules and the chart's ServiceMonitor use


def _traffic(client: ExecutorClient, round_: int) -> None:
    """One round of steps that touches every path and outcome; rows/slots differ per round."""
    base = 1000 * round_
    row = 1 + 4 * round_
    client.forward(
        make_extend_batch(
            input_ids=[[5, 6, 7]],
            req_pool_indices=[row],
            out_cache_loc=[[base + 1, base + 2, base + 3]],
            return_logprob=True,
            top_logprobs_num=2,
        )
    )  # piecewise (3 tokens -> 8)
    client.forward(
        make_decode_batch(
            input_ids=[9], req_pool_indices=[row], seq_lens=[4], out_cache_loc=[base + 4]
        )
    )  # full graph
    client.forward(
        make_extend_batch(
            input_ids=[[1] * 12],
            req_pool_indices=[row + 1],
            out_cache_loc=[list(range(base + 10, base + 22))],
        )
    )  # too long: eager fallback
    rows = [row, row + 1, row + 2]
    client.forward(
        make_extend_batch(input_ids=[[2]], req_pool_indices=[row + 2], out_cache_loc=[[base + 30]])
    )
    client.forward(
        make_decode_batch(
            input_ids=[3, 3, 3],
            req_pool_indices=rows,
            seq_lens=[5, 13, 2],
            out_cache_loc=[base + 40, base + 41, base + 42],
        )
    )  # bs 3 > 2: fallback
    with pytest.raises(grpc.RpcError):  # a refused batch: requests_total{code="INVALID_ARGUMENT"}
        client.forward(
            make_decode_batch(
                input_ids=[3], req_pool_indices=[0], seq_lens=[2], out_cache_loc=[base + 50]
            )
        )


@pytest.mark.slow
def test_dashboards_and_alerts_evaluate_against_a_live_executor(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    config = tiny_config(
        tmp_path / "cache", graph_mode="both", graph_batch_sizes="1,2", piecewise_token_sizes="8"
    )
    with running_server(config) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as client:
        assert srv.metrics_port
        _traffic(client, 0)
        client.update_runtime_config(
            RuntimeConfigUpdate(eager_input_no_copy=True, graph_mode="none")
        )
        _traffic(client, 1)  # eager_no_copy
        client.update_runtime_config(
            RuntimeConfigUpdate(eager_input_no_copy=False, graph_mode="both")
        )
        scrape = {
            "job_name": JOB,
            "static_configs": [{"targets": [f"127.0.0.1:{srv.metrics_port}"]}],
        }
        with running_prometheus(
            prometheus_binaries, tmp_path / "prom", scrape_configs=[scrape], rule_files=[RULES]
        ) as prom:
            prom.wait_for_scrape(JOB)
            _traffic(client, 2)  # increases between scrapes, so rate() has something to see
            time.sleep(3)  # three more 1 s scrapes and rule evaluations
            scraped = prom.metric_names()
            queries = all_queries()
            assert len(queries) > 30  # the dashboards and rules really were found
            unknown: dict[str, set[str]] = {}
            for q in queries:
                prom.query(q.promql)  # raises with Prometheus's own error message
                missing = metric_names(q.promql) - scraped
                if missing:
                    unknown[q.source] = missing
            assert not unknown, f"expressions use metrics the executor does not export: {unknown}"
            groups = prom.get("/api/v1/rules")["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert rules and all(r["health"] == "ok" for r in rules), [
                (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
            ]
            # The traffic shows up where the dashboards look for it.
            paths = {
                s["metric"]["path"]
                for s in prom.query("model_executor_forward_seconds_count")["result"]
            }
            assert {"eager", "eager_no_copy", "full_graph", "piecewise"} <= paths
