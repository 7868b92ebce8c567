-- wrk: half non-streamed completions, half streamed chat completions, each of
-- TOKENS output tokens (ignore_eos); prints a JSON summary line at the end.
-- Used by benchmarks/serve_short.py: wrk -s short_requests.lua <url> -- MODEL TOKENS
local model, tokens
local n = 0

function init(args)
  model = args[1]
  tokens = tonumber(args[2])
end

function request()
  n = n + 1
  local headers = { ["Content-Type"] = "application/json" }
  if n % 2 == 1 then
    local body = string.format(
      '{"model":"%s","prompt":"short request %d","max_tokens":%d,"ignore_eos":true}',
      model, n, tokens)
    return wrk.format("POST", "/v1/completions", headers, body)
  end
  local body = string.format(
    '{"model":"%s","messages":[{"role":"user","content":"short %d"}],"max_tokens":%d,'
      .. '"ignore_eos":true,"stream":true}', model, n, tokens)
  return wrk.format("POST", "/v1/chat/completions", headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"connect_errors":%d,"read_errors":%d,'
      .. '"write_errors":%d,"timeouts":%d,"non_2xx":%d,"latency_p50_us":%d,"latency_p99_us":%d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
