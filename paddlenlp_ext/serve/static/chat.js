// The chat page: picks a served model (GET /v1/models), keeps the conversation, streams each answer from
// POST /v1/chat/completions (stream: true) with fetch + ReadableStream, and aborts the fetch on Stop
// (the server notices the disconnect and stops generating for this request).  No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { turns: [], controller: null };  // turns: [{role, content}] of the current conversation
const KEY_ITEM = "paddlenlp_ext.api_key";  // a server started with --api_key: asked once, kept in this browser

// fetch with the API key (if one was given); a 401 asks for the key once and retries with it
async function apiFetch(url, options = {}) {
  const withKey = () => {
    const headers = Object.assign({}, options.headers || {});
    const key = localStorage.getItem(KEY_ITEM);
    if (key) headers["Authorization"] = "Bearer " + key;
    return fetch(url, Object.assign({}, options, { headers }));
  };
  let res = await withKey();
  if (res.status === 401) {
    const key = window.prompt("This server needs its API key (--api_key):");
    if (key) {
      localStorage.setItem(KEY_ITEM, key.trim());
      res = await withKey();
    }
  }
  return res;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : role === "assistant" ? $("model").value : "Error";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("model").disabled = busy;
}

async function loadModels() {
  try {
    const res = await apiFetch("/v1/models");
    if (!res.ok) throw new Error(`${res.status}: ${(await res.json()).error.message}`);
    const body = await res.json();
    for (const m of body.data) {
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = m.parent ? `${m.id} (adapter on ${m.parent})` : `${m.id} (base)`;
      $("model").append(opt);
    }
    $("status").textContent = `${body.data.length} model(s) served`;
  } catch (err) {
    $("status").textContent = "cannot list the models: " + err;
  }
}

// Server-sent events: "data: {json}\n\n" records, the last one "data: [DONE]".
function parseEvents(buffer, onData) {
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const record = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    for (const line of record.split("\n")) {
      if (line.startsWith("data: ")) onData(line.slice(6));
    }
  }
  return buffer;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.turns);
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true } };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  return body;
}

async function send(text) {
  state.turns.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const out = div.querySelector(".text");
  state.controller = new AbortController();
  setBusy(true);
  $("status").textContent = "generating...";
  let answer = "", finish = null, usage = null;
  try {
    const res = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: state.controller.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({ error: { message: res.statusText } }));
      throw new Error(`${res.status}: ${err.error ? err.error.message : res.statusText}`);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer = parseEvents(buffer + decoder.decode(value, { stream: true }), (data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          if (c.delta && c.delta.content) { answer += c.delta.content; out.textContent = answer; }
          if (c.finish_reason) finish = c.finish_reason;
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      });
    }
    $("status").textContent = `done (${finish || "?"}` + (usage ? `, ${usage.completion_tokens} tokens)` : ")");
  } catch (err) {
    if (err.name === "AbortError") {
      $("status").textContent = "stopped";
      div.classList.add("stopped");
    } else {
      div.remove();
      addMessage("error", String(err.message || err));
      $("status").textContent = "error";
      state.turns.pop();  // the question was not answered: it is not part of the conversation
      return;
    }
  } finally {
    div.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
  }
  state.turns.push({ role: "assistant", content: answer });  // a stopped answer stays as far as it got
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.turns = [];
  $("messages").textContent = "";
  $("status").textContent = "new conversation";
});
$("model").addEventListener("change", () => { $("status").textContent = "model: " + $("model").value; });
loadModels();
