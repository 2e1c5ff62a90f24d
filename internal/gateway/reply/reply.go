// Package reply writes the broker's JSON answers: a value, or the
// {"error":"…"} envelope. Every HTTP layer of the gateway (the core's
// routes, the console, the A2A door) answers through it.
//
// It imports nothing of the project.
package reply

import (
	"encoding/json"
	"net/http"
)

// JSON answers v with status.
func JSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// Error answers the broker's {"error":"…"} envelope.
func Error(w http.ResponseWriter, status int, text string) {
	JSON(w, status, map[string]string{"error": text})
}
