// dsv4 chat page: a conversation with the served model through POST /v1/chat/completions,
// streamed (server-sent events read with fetch and a ReadableStream). The conversation and the
// settings live in localStorage, the API key in sessionStorage (this tab only). Model output
// is only ever set as textContent, never parsed as HTML.
"use strict";

const STORE = "dsv4-chat";         // localStorage: {messages, settings}
const KEY_STORE = "dsv4-api-key";  // sessionStorage
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "thinking"];  // element ids too
const DEFAULTS = {system: "", temperature: "", top_p: "", max_tokens: "1024", thinking: false};

const $ = (id) => document.getElementById(id);
const state = load();     // {messages: [{role, content, reasoning?, tool_calls?, error?, meta?}], settings}
let model = null;         // the served model's id, from /v1/models
let running = null;       // the AbortController of the answer streaming now

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.messages)) {
      return {messages: saved.messages, settings: {...DEFAULTS, ...saved.settings}};
    }
  } catch (e) { /* a broken store starts afresh */ }
  return {messages: [], settings: {...DEFAULTS}};
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

// ------------------------------------------------------------------ the API
function headers() {
  const h = {"Content-Type": "application/json"};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(res) {  // "401: invalid or missing API key ..." from OpenAI's error shape
  let message = res.statusText;
  try { message = (await res.json()).error.message; } catch (e) { /* not JSON */ }
  return `${res.status}: ${message}`;
}

async function loadModel() {
  const label = $("model");
  try {
    const res = await fetch("/v1/models", {headers: headers()});
    if (!res.ok) throw new Error(await errorText(res));
    model = (await res.json()).data[0].id;
    label.textContent = model;
    label.classList.remove("error");
  } catch (e) {
    model = null;
    label.textContent = e.message;
    label.classList.add("error");
  }
}

function requestBody(history) {
  const s = state.settings;
  const messages = s.system.trim() ? [{role: "system", content: s.system}] : [];
  // the text of each turn, but no failed or empty answer; no reasoning (the encoding drops an
  // earlier turn's anyway) and no tool calls (the page offers no tools)
  for (const m of history) {
    if (!m.error && m.content) messages.push({role: m.role, content: m.content});
  }
  const body = {messages, stream: true, stream_options: {include_usage: true},
                thinking: {type: s.thinking ? "enabled" : "disabled"}};
  if (model) body.model = model;
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    if (s[name] !== "") body[name] = Number(s[name]);
  }
  return body;
}

// Calls onEvent with each `data:` event's JSON and onRead after each piece read; true at
// `data: [DONE]`, false if the stream ends without it.
async function readEvents(res, onEvent, onRead) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, {stream: true}).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return true;
      if (data) onEvent(JSON.parse(data));
    }
    onRead();
  }
}

function addChunk(reply, chunk) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.usage) reply.tokens = chunk.usage.completion_tokens;
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    if (d.content) reply.content += d.content;
    const thought = d.reasoning_content ?? d.reasoning;
    if (thought) reply.reasoning = (reply.reasoning || "") + thought;
    for (const t of d.tool_calls || []) {  // the name first, then the arguments in pieces
      reply.tool_calls ??= [];
      const call = reply.tool_calls[t.index ?? 0] ??= {name: "", arguments: ""};
      if (t.function?.name) call.name += t.function.name;
      if (t.function?.arguments) call.arguments += t.function.arguments;
    }
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
}

async function send(text) {
  const controller = running = new AbortController();
  setBusy(true);
  if (!model) await loadModel();  // a key typed in since the page loaded
  const history = state.messages.slice();
  history.push({role: "user", content: text});
  const reply = {role: "assistant", content: "", model};
  state.messages = [...history, reply];
  save();
  render();
  let view = $("messages").lastElementChild;
  const redraw = () => { view = show(reply, view); };
  const t0 = performance.now();
  try {
    const res = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: controller.signal,
                                                      body: JSON.stringify(requestBody(history))});
    if (!res.ok) throw new Error(await errorText(res));
    if (!await readEvents(res, (chunk) => addChunk(reply, chunk), redraw)) {
      throw new Error("the stream ended before its end ([DONE])");
    }
  } catch (e) {
    if (e.name === "AbortError") reply.finish = "stopped";
    else reply.error = e.message;
  } finally {
    const seconds = (performance.now() - t0) / 1000;
    const parts = [reply.finish, reply.tokens && `${reply.tokens} tokens, ${(reply.tokens / seconds).toFixed(1)} tokens/s`];
    reply.meta = parts.filter(Boolean).join(" · ");
    if (running === controller) {
      running = null;
      setBusy(false);
    }
    if (state.messages.includes(reply)) {  // not cleared meanwhile by "New chat"
      redraw();
      save();
    }
  }
}

// ------------------------------------------------------------------ the view
function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function messageView(m) {
  const box = el("div", `msg ${m.role}`);
  box.append(el("div", "role", m.role === "user" ? "You" : (m.model || "Assistant")));
  if (m.reasoning) {
    const details = el("details", "reasoning");
    details.append(el("summary", "", "Thinking"), el("div", "text", m.reasoning));
    box.append(details);
  }
  if (m.content) box.append(el("div", "text", m.content));
  for (const call of m.tool_calls || []) {
    const view = el("div", "tool-call");
    view.append(el("span", "name", `tool call: ${call.name}`), el("code", "", call.arguments));
    box.append(view);
  }
  if (m.error) box.append(el("div", "error", m.error));
  if (m.meta) box.append(el("div", "meta", m.meta));
  if (box.childElementCount === 1) box.append(el("div", "meta", "…"));
  return box;
}

// Replaces `old` (a message's view) with a fresh one, keeping its thinking block open or
// folded, and the list scrolled to the bottom if it was there.
function show(m, old) {
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  const box = messageView(m);
  const wasOpen = old.querySelector("details")?.open;
  if (wasOpen && box.querySelector("details")) box.querySelector("details").open = true;
  old.replaceWith(box);
  if (atBottom) list.scrollTop = list.scrollHeight;
  return box;
}

function render() {
  const list = $("messages");
  list.replaceChildren(...state.messages.map(messageView));
  if (!state.messages.length) list.append(el("p", "empty", "Ask something: the answer streams in here."));
  list.scrollTop = list.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

// ------------------------------------------------------------------ wiring
function init() {
  for (const id of SETTINGS) {
    const input = $(id);
    const prop = input.type === "checkbox" ? "checked" : "value";
    input[prop] = state.settings[id];
    input.addEventListener(prop === "checked" ? "change" : "input", () => { state.settings[id] = input[prop]; save(); });
  }
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("input", () => {
    if (key.value) sessionStorage.setItem(KEY_STORE, key.value);
    else sessionStorage.removeItem(KEY_STORE);
  });
  key.addEventListener("change", loadModel);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running?.abort());  // the server cancels the request
  $("new-chat").addEventListener("click", () => {
    running?.abort();
    state.messages = [];
    save();
    render();
    $("prompt").focus();
  });
  render();
  loadModel();
}

init();
