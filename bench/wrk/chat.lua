-- wrk script of bench/gateway.py: POSTs chat requests and prints one JSON line ("WRKJSON {...}") at the end.
--
--   wrk -t T -c C -d 5s -s bench/wrk/chat.lua URL -- MODE TURNS STREAM KEY TAG [BODY_FILE]
--
-- MODE "raw": every request sends BODY_FILE as is (single-turn, or the upstream's native /generate body).
-- MODE "named": as "session", but each session is a named one: the connection first creates it
--   (POST /v1/sessions with KEY, a runner key: one request, not timed as a turn nor counted in
--   "chat_requests") and sends its turns with the session's own key.
-- MODE "session": each connection runs sessions of TURNS turns with a growing history: turn k sends the
--   system prompt, k user messages and, between them, the k-1 assistant replies the upstream gives (the
--   stand-in always answers REPLY), so a recording gateway links turn k to turn k-1. Run it with one
--   connection per thread (-t C -c C): wrk keeps one Lua state per thread, which is then the state of
--   one connection, and each response comes before that connection's next request.
-- Latency per turn index is timed here (monotonic clock through LuaJIT's FFI) and reported as p50 per turn;
-- wrk's own latency histogram gives the overall percentiles.
local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } agentrl_timespec;
int clock_gettime(int clk_id, agentrl_timespec *tp);
]]
local ts = ffi.new("agentrl_timespec")
local function now_us()
  ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end

REPLY = "Hello! How can I help you today?"
local SYSTEM = '{"role":"system","content":"You are a helpful assistant."}'
local threads = {}
local next_id = 0

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
  table.insert(threads, thread)
end

function init(args)
  mode, turns, stream, key, tag = args[1], tonumber(args[2]), args[3] == "1", args[4], args[5]
  headers = {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. key}
  if mode == "raw" then
    local f = assert(io.open(args[6], "rb"))
    raw_body = f:read("*a")
    f:close()
  end
  session, turn, started = 0, 1, 0
  session_key, creating = nil, false
  sessions_url = string.gsub(wrk.path, "/chat/completions$", "/sessions")
  -- latency (us) and turn index of each response, as two flat lists: wrk copies flat tables between
  -- threads at the end, and crashes on nested ones
  lat_us, lat_turn = {}, {}
  bad = 0
end

local function user(k)
  if k == 1 then
    return string.format('{"role":"user","content":"Session %s-%d-%d. What is %d + %d?"}', tag, thread_id,
      session, thread_id, session)
  end
  return string.format('{"role":"user","content":"And now add %d to that?"}', k)
end

local function session_body()
  local parts = {SYSTEM}
  for k = 1, turn do
    if k > 1 then parts[#parts + 1] = '{"role":"assistant","content":"' .. REPLY .. '"}' end
    parts[#parts + 1] = user(k)
  end
  return string.format('{"model":"standin","max_tokens":64,"stream":%s,"messages":[%s]}',
    stream and "true" or "false", table.concat(parts, ","))
end

function request()
  if mode == "named" and session_key == nil then
    creating = true
    return wrk.format("POST", sessions_url, headers, string.format('{"group_id":"bench-%s-%d"}', tag, thread_id))
  end
  local body = raw_body
  local with = headers
  if mode ~= "raw" then body = session_body() end
  if mode == "named" then
    with = {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. session_key}
  end
  started = now_us()
  return wrk.format("POST", nil, with, body)
end

function response(status, _, body)
  if creating then
    creating = false
    session_key = status == 200 and string.match(body, '"api_key"%s*:%s*"([^"]+)"') or nil
    if session_key == nil then bad = bad + 1 end
    return
  end
  local took = now_us() - started
  if status ~= 200 then
    session_key = nil
    bad = bad + 1
    turn, session = 1, session + 1 -- the history is broken: start a new session
    return
  end
  lat_us[#lat_us + 1] = took
  lat_turn[#lat_turn + 1] = turn
  turn = turn + 1
  if turn > turns then turn, session, session_key = 1, session + 1, nil end
end

local function p50(values)
  table.sort(values)
  return values[math.floor(#values / 2) + 1]
end

function done(summary, latency, _)
  local per_turn = {}
  local non200 = 0
  local chats = 0
  for _, thread in ipairs(threads) do
    non200 = non200 + (thread:get("bad") or 0)
    local us, turn_of = thread:get("lat_us") or {}, thread:get("lat_turn") or {}
    chats = chats + #us
    for i, v in ipairs(us) do
      local k = turn_of[i]
      per_turn[k] = per_turn[k] or {}
      per_turn[k][#per_turn[k] + 1] = v
    end
  end
  local all = {}
  for _, values in pairs(per_turn) do
    for _, v in ipairs(values) do all[#all + 1] = v end
  end
  local turn_p50, turn_n = {}, {}
  local n_turns = threads[1] and threads[1]:get("turns") or 1
  for k = 1, n_turns do
    local values = per_turn[k] or {}
    turn_p50[k] = #values > 0 and string.format("%.1f", p50(values)) or "null"
    turn_n[k] = tostring(#values)
  end
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect_errors":%d,"read_errors":%d,' ..
    '"write_errors":%d,"status_errors":%d,"timeouts":%d,"non200":%d,"p50_us":%.1f,"p90_us":%.1f,' ..
    '"p99_us":%.1f,"mean_us":%.1f,"max_us":%.1f,"turn_p50_us":[%s],"turn_n":[%s],"chat_requests":%d,"chat_p50_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    non200, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max,
    table.concat(turn_p50, ","), table.concat(turn_n, ","), chats, #all > 0 and p50(all) or 0))
end
