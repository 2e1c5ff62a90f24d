package spawnd

// sandbox: strict runs an instance in bubblewrap, which spawnd execs
// already as the principal's uid (exec.go's credential): bwrap is never run
// with privilege, and maps that uid 1:1 into a user namespace of its own
// (so no instance gains a capability over anything of the host's), in
// which it may create no further one. It then gets its own mount, PID, IPC
// and UTS namespaces; the host's root read-only; a private /tmp and
// /dev/shm; a minimal /dev; a /proc showing its own processes alone; its
// HOME, the one writable place; and its temp config, read-only. The
// network is the host's: an instance dials the gateway back over TCP.
// bwrap sets no_new_privs itself. No --new-session: the instance is in
// spawnd's new session already, and release's SIGTERM to the process
// group must reach the engine (bwrap forwards no signal and dies of it at
// once; the supervisor then waits for the engine: drainSandbox); no
// --die-with-parent: an instance outlives a spawnd restart. All mounting is
// bubblewrap's: spawnd has no mount code.

// sandboxArgv wraps argv in bubblewrap; home and config are bound only when
// set (the boot probe has neither).
func sandboxArgv(bwrap, home, config string, argv []string) []string {
	out := []string{bwrap,
		"--unshare-user", "--disable-userns",
		"--unshare-pid", "--unshare-ipc", "--unshare-uts",
		"--ro-bind", "/", "/",
		"--dev", "/dev",
		"--proc", "/proc",
		"--tmpfs", "/tmp",
		"--tmpfs", "/dev/shm",
	}
	if home != "" {
		out = append(out, "--bind", home, home, "--chdir", home)
	}
	if config != "" {
		out = append(out, "--ro-bind", config, config)
	}
	return append(append(out, "--"), argv...)
}
