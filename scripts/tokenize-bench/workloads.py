"""The wrk scripts of scripts/tokenize-bench/run.sh beyond the shared tokenize bench's own.

growing-chat: 16 conversations that grow a turn at a time (a 2 KB system prompt, then user and
assistant turns of about 1 KB each, up to 24 turns, starting again), each request one conversation's
next turn: the earlier turns are the same text as in its previous request.
Text: Python's standard library, as the shared bench takes it. Also writes growing-held-bodies.txt:
each conversation's longest request, whose rendered prompt starts with every shorter request's, for
the stand-in engine that holds the conversations. Usage: workloads.py OUT_DIR
"""
import json
import pathlib
import sys
import sysconfig

out = pathlib.Path(sys.argv[1])
lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
text = "".join(p.read_text(errors="replace") for p in sorted(lib.glob("b*.py")))
clean = "".join(c if (c.isprintable() and c not in '\\"') else " " for c in text).replace("]]", "] ]")
corpus = clean[:400000]
growing = "counter = 0\nlocal corpus = [[" + corpus + """]]
local function piece(k, len)
  local start = (k * 7919) % (string.len(corpus) - len) + 1
  return string.sub(corpus, start, start + len - 1)
end
request = function()
  counter = counter + 1
  local conversation = counter % 16
  local turns = math.floor(counter / 16) % 24
  local messages = '{"role":"system","content":"' .. piece(conversation, 2000) .. '"}'
  for t = 1, turns do
    messages = messages .. ',{"role":"user","content":"' .. piece(conversation * 100 + t, 1000) .. '"}'
    messages = messages .. ',{"role":"assistant","content":"' .. piece(conversation * 100 + t + 50, 1000) .. '"}'
  end
  messages = messages .. ',{"role":"user","content":"' .. piece(conversation * 100 + turns + 1, 1000) .. '"}'
  local body = '{"model":"fake-model","messages":[' .. messages .. '],"max_tokens":8}'
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"]="application/json"}, body)
end
"""
(out / "growing-chat.lua").write_text(growing)


def piece(k, length):
    """The Lua script's piece(): corpus is ASCII, so Lua's byte offsets are Python's indices."""
    start = (k * 7919) % (len(corpus) - length)
    return corpus[start : start + length]


assert corpus.isascii()
with open(out / "growing-held-bodies.txt", "w") as held:
    for conversation in range(16):
        turns = 23
        messages = [{"role": "system", "content": piece(conversation, 2000)}]
        for t in range(1, turns + 1):
            messages.append({"role": "user", "content": piece(conversation * 100 + t, 1000)})
            messages.append({"role": "assistant", "content": piece(conversation * 100 + t + 50, 1000)})
        messages.append({"role": "user", "content": piece(conversation * 100 + turns + 1, 1000)})
        held.write(json.dumps({"model": "fake-model", "messages": messages}) + "\n")
