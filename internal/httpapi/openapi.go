package httpapi

import (
	_ "embed"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
)

// openAPIDoc describes every route Handler serves. The e2e tests validate
// it and check every response they receive against it, so a route or a
// status added without describing it fails there.
//
//go:embed openapi.json
var openAPIDoc []byte

// OpenAPI returns the OpenAPI 3.1 document GET /openapi.json serves.
func OpenAPI() []byte { return openAPIDoc }

// handleOpenAPI is GET /openapi.json. It is under auth: like every route
// but the health probe and the instance dial-back.
func handleOpenAPI(w http.ResponseWriter, _ *http.Request, _ auth.Principal) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(openAPIDoc)
}
