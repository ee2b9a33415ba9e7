// The admin API with the admin key the user gave, kept in this tab's sessionStorage.
const STORE = "llmgw-admin-key";

export class AuthError extends Error {}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function adminKey() {
  return sessionStorage.getItem(STORE);
}

export function setAdminKey(key) {
  if (key) sessionStorage.setItem(STORE, key);
  else sessionStorage.removeItem(STORE);
}

// /console?key=... once: keep it, and take it out of the address bar (and so out of the history)
export function takeKeyFromUrl() {
  const url = new URL(window.location.href);
  const key = url.searchParams.get("key");
  if (key === null) return;
  setAdminKey(key);
  url.searchParams.delete("key");
  window.history.replaceState(null, "", url.pathname + url.search + url.hash);
}

export async function api(path, { method = "GET", body } = {}) {
  const headers = { Authorization: `Bearer ${adminKey() || ""}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (response.status === 401 || response.status === 403) {
    throw new AuthError(errorText(data) || `HTTP ${response.status}`);
  }
  if (!response.ok) throw new ApiError(response.status, errorText(data) || `HTTP ${response.status}`);
  return data;
}

function errorText(data) {
  if (!data) return "";
  const err = data.error;
  if (typeof err === "string") return err;
  if (err && typeof err.message === "string") return err.message;
  return data.detail || "";
}
