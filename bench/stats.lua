-- wrk script: prints one machine-readable line when the run is over.
-- summary.errors.status counts responses with a status >= 400 (wrk's
-- "Non-2xx or 3xx responses"), so allowed = requests - non2xx. Latencies are
-- wrk's own histogram (the one --latency prints), in microseconds.
done = function(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      "BENCH requests=%d duration_us=%d non2xx=%d connect=%d read=%d write=%d timeout=%d p50_us=%d p99_us=%d mean_us=%.1f\n",
      summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
      latency:percentile(50.0), latency:percentile(99.0), latency.mean))
end
