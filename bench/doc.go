// Package bench holds comparisons of idemhttp with its peers. It is a module
// of its own so that peers never become dependencies of the library.
package bench
