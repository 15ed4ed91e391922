"""metrics_endpoint.Endpoint: /metrics served, and `final()` keeps the last figures up until a
scraper that is watching has them, never waiting where nobody scrapes."""

from __future__ import annotations

import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from spectrain_workloads.metrics_endpoint import Endpoint
from tests.launch import free_ports
from tests.waiting import wait_for


def _value(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "figure"]
    return fam.samples[0].value


def _endpoint() -> tuple[Endpoint, Gauge]:
    reg = CollectorRegistry()
    g = Gauge("figure", "a figure", registry=reg)
    return Endpoint(reg, free_ports(1)[0]), g


def test_nobody_scraping_ends_at_once() -> None:
    ep, g = _endpoint()
    try:
        assert _value(ep.port) == 0      # one scrape: no interval known, so nobody is watching
        g.set(2)
        t0 = time.monotonic()
        assert ep.final() is False
        assert time.monotonic() - t0 < 0.5     # no wait: far below any interval's 1.5 x
    finally:
        ep.stop()


def test_final_waits_for_a_scrape_of_the_last_figures() -> None:
    ep, g = _endpoint()
    seen: list[float] = []
    done = threading.Event()

    def scraper() -> None:
        while not done.wait(0.2):
            seen.append(_value(ep.port))

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    try:
        # a scraper is watching once two scrapes were served
        wait_for(lambda: ep.scrape_interval() is not None, 10, interval=0.05, what="two scrapes")
        g.set(7)
        assert ep.final() is True
        done.set()                         # no scrape starts from here on
        t.join()
        assert seen[-1] == 7, seen         # the scrape final() waited for carried the last figure
    finally:
        done.set()
        t.join()
        ep.stop()


def test_a_scraper_that_went_away_is_waited_for_at_most_one_and_a_half_intervals() -> None:
    ep, _ = _endpoint()
    try:
        for _ in range(3):
            _value(ep.port)
        interval = ep.scrape_interval()
        assert interval is not None
        t0 = time.monotonic()
        assert ep.final() is False
        waited = time.monotonic() - t0
        assert 1.5 * interval + 0.5 - 0.05 <= waited <= 1.5 * interval + 0.5 + 1.0, (waited, interval)
        t0 = time.monotonic()
        assert ep.final(max_s=0.1) is False    # the cap bounds the wait whatever the interval
        assert time.monotonic() - t0 < 0.5
    finally:
        ep.stop()
