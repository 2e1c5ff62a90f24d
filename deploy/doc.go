// Package deploy is nexus-broker's production deployment: the systemd units
// of nexus-spawnd and the gateway, an example broker.yaml, sysusers and
// tmpfiles snippets, and OPERATIONS.md, the operator's guide to them. It
// holds no code. Its test checks that the example loads with the broker's
// own config loader, that the files agree with each other (paths, users,
// ids, which directories instances may write), and, where systemd-analyze
// is installed, that systemd accepts both units.
//
// It imports nothing.
package deploy
