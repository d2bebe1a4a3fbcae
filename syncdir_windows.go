package idemhttp

// syncDir is a no-op on Windows, where directories cannot be flushed and
// NTFS journals renames itself.
func syncDir(dir string) error { return nil }
