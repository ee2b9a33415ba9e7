// The console: one page per hash route (#/models, ...), each refreshed every few seconds from the admin API.
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { AuthError, adminKey, setAdminKey, takeKeyFromUrl } from "./api.js";
import { h } from "./dom.js";
import charts from "./pages/charts.js";
import keys from "./pages/keys.js";
import models from "./pages/models.js";
import rollouts from "./pages/rollouts.js";
import shadow from "./pages/shadow.js";

const PAGES = { models, rollouts, charts, shadow, keys };
const REFRESH_MS = 5000;

let current = null; // {name, view, timer}

function pageName() {
  const name = window.location.hash.replace(/^#\/?/, "").split("?")[0];
  return PAGES[name] ? name : "models";
}

function showLogin(message) {
  stop();
  document.getElementById("app").replaceChildren();
  document.getElementById("login").hidden = false;
  document.getElementById("forget").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("key").focus();
}

function stop() {
  if (!current) return;
  clearInterval(current.timer);
  current.view?.destroy?.();
  current = null;
}

async function refresh(state) {
  if (state.busy) { // a slow answer: one more refresh when it is in, rather than a pile of them
    state.again = true;
    return;
  }
  state.busy = true;
  state.again = false;
  try {
    await state.view.refresh();
    state.root.dataset.loaded = "true"; // what a test waits for: the page has drawn its data once
    state.error.textContent = "";
  } catch (err) {
    if (err instanceof AuthError) {
      setAdminKey(null);
      showLogin(`The admin API refused the key: ${err.message}`);
    } else {
      state.error.textContent = err.message;
      console.warn("console refresh failed:", err);
    }
  } finally {
    state.busy = false;
  }
  if (state.again && current === state) await refresh(state);
}

function open() {
  stop();
  if (!adminKey()) {
    showLogin();
    return;
  }
  document.getElementById("login").hidden = true;
  document.getElementById("forget").hidden = false;
  const name = pageName();
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === name);
  const root = h("section", { id: `page-${name}`, class: "page" });
  const error = h("p", { class: "error", id: "page-error" });
  document.getElementById("app").replaceChildren(h("h2", {}, PAGES[name].title), error, root);
  const state = { name, root, error, busy: false };
  // the page reloads itself after an action (a rollout button) through this
  state.view = PAGES[name].create(root, { reload: () => refresh(state) });
  state.timer = setInterval(() => refresh(state), REFRESH_MS);
  current = state;
  refresh(state);
}

function start() {
  takeKeyFromUrl();
  document.getElementById("login").addEventListener("submit", (event) => {
    event.preventDefault();
    setAdminKey(document.getElementById("key").value.trim());
    document.getElementById("key").value = "";
    open();
  });
  document.getElementById("forget").addEventListener("click", () => {
    setAdminKey(null);
    showLogin();
  });
  window.addEventListener("hashchange", open);
  open();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
