// The staff console's only script: live refresh over server-sent events, and the recording's
// playhead on the timeline. Pages work without it (reload to see changes).
"use strict";

// The only way HTML from the server reaches the page (the CSP's Trusted Types allow this one
// policy, so `innerHTML = string` throws in Chromium). A fetched fragment is parsed into a
// detached document, where nothing runs or loads; only the server's <template> for this section
// is taken from it, and any script, frame or inline handler is dropped before it is moved in.
const fragmentPolicy = window.trustedTypes
  ? window.trustedTypes.createPolicy("console-fragment", { createHTML: (html) => html })
  : null;

function fragmentFor(section, html) {
  const markup = fragmentPolicy ? fragmentPolicy.createHTML(html) : html;
  const parsed = new DOMParser().parseFromString(markup, "text/html");
  const template = parsed.querySelector("template[data-fragment]");
  if (!template || template.dataset.fragment !== section.id) return null;
  const content = document.importNode(template.content, true);
  content.querySelectorAll("script, iframe, frame, object, embed, base, meta, link").forEach((el) => el.remove());
  content.querySelectorAll("*").forEach((el) => {
    for (const attr of Array.from(el.attributes)) {
      if (attr.name.toLowerCase().startsWith("on")) el.removeAttribute(attr.name);
    }
  });
  return content;
}

// Replace a page section with its server-rendered fragment whenever the server says it changed.
function liveSection(section) {
  const source = section.dataset.live;
  const fragment = section.dataset.fragment;
  if (!source || !fragment || !window.EventSource) return;
  let pending = null;
  let running = false;
  async function refresh() {
    if (running) { pending = pending || setTimeout(() => { pending = null; refresh(); }, 300); return; }
    running = true;
    try {
      const response = await fetch(fragment, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } });
      if (response.redirected || response.status === 401 || response.status === 303) {
        window.location.reload();  // the session ended: the page redirects to the login
        return;
      }
      const type = response.headers.get("content-type") || "";
      const content = response.ok && type.startsWith("text/html") ? fragmentFor(section, await response.text()) : null;
      if (content) {
        section.replaceChildren(content);
        section.dataset.version = String(Number(section.dataset.version || 0) + 1);
        document.dispatchEvent(new CustomEvent("console:refreshed", { detail: section }));
      }
    } finally {
      running = false;
    }
  }
  const events = new EventSource(source, { withCredentials: true });
  events.addEventListener("changed", () => {
    if (!pending) pending = setTimeout(() => { pending = null; refresh(); }, 250);
  });
  events.addEventListener("ready", () => { section.dataset.live_ready = "1"; section.setAttribute("data-connected", "1"); });
}

// The recording's playhead: a line across all lanes at the audio's position on the timeline.
function playhead() {
  const audio = document.getElementById("recording");
  if (!audio) return;
  const offset = Number(audio.dataset.offsetMs || 0);
  function lanes() { return document.querySelector(".lanes"); }
  function place() {
    const box = lanes();
    if (!box) return;
    const line = box.querySelector(".playhead");
    const duration = Number(box.dataset.durationMs || 1);
    const t = offset + audio.currentTime * 1000;
    line.hidden = false;
    line.style.left = Math.max(0, Math.min(100, (t / duration) * 100)) + "%";
    line.dataset.t = String(Math.round(t));
    let current = null;
    document.querySelectorAll(".transcript li[data-t]").forEach((li) => {
      li.classList.remove("playing");
      if (Number(li.dataset.t) <= t) current = li;
    });
    if (current && !audio.paused) current.classList.add("playing");
  }
  let frame = null;
  function tick() { place(); frame = audio.paused ? null : requestAnimationFrame(tick); }
  audio.addEventListener("play", () => { if (!frame) frame = requestAnimationFrame(tick); });
  audio.addEventListener("timeupdate", place);
  audio.addEventListener("seeked", place);
  document.addEventListener("console:refreshed", place);
  function seekTo(t) {
    const at = Math.max(0, (t - offset) / 1000);
    if (Number.isFinite(audio.duration)) audio.currentTime = Math.min(at, audio.duration);
    else audio.currentTime = at;
    place();
  }
  // Click on a track: jump there. Click a transcript line: jump to it.
  document.addEventListener("click", (event) => {
    const li = event.target.closest(".transcript li[data-t]");
    if (li) { seekTo(Number(li.dataset.t)); return; }
    const track = event.target.closest(".lane .track");
    if (track && !event.target.closest("a")) {
      const rect = track.getBoundingClientRect();
      const duration = Number(lanes().dataset.durationMs || 1);
      seekTo(((event.clientX - rect.left) / rect.width) * duration);
    }
  });
}

// Tap an item to read its details (no hover on phones).
function details() {
  document.addEventListener("click", (event) => {
    const item = event.target.closest(".item");
    const box = document.getElementById("item-detail");
    if (item && box && !item.href) box.textContent = item.title;
  });
}

// A call that ended while watched: its live actions go, and once its recording is stored, the
// page loads again with its player.
function reloadForRecording() {
  document.addEventListener("console:refreshed", () => {
    const state = document.getElementById("live-state");
    const actions = document.getElementById("call-actions");
    if (state && actions && !["ringing", "in_progress"].includes(state.dataset.status)) {
      actions.hidden = true;
    }
    if (state && state.dataset.recording === "1" && !document.getElementById("recording")) {
      window.location.reload();
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  reloadForRecording();
  document.querySelectorAll("[data-live]").forEach(liveSection);
  playhead();
  details();
});
