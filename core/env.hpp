#pragma once
// The one place tutti reads its environment. Every variable tutti looks at is declared in the table
// in env.cpp (name, NCCL alias, default, meaning); docs/ENVIRONMENT.md is checked against it by a
// test, so the documentation cannot drift from the code. Asking for an undeclared name is a bug.

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tutti::env {

struct Variable {
  std::string_view name;     // TUTTI_* (or NCCL_* when tutti has no name of its own)
  std::string_view alias;    // the NCCL_* spelling honoured as well, or empty
  std::string_view fallback; // default as text; empty = unset
  std::string_view meaning;
};

// All declared variables, in documentation order.
std::span<const Variable> variables();

// The raw value: the variable itself, else its alias, else nullopt. Throws InternalError for an
// undeclared name.
std::optional<std::string> raw(std::string_view name);
// Whether the user chose a value: raw() is set and not empty (an empty variable reads as unset).
bool is_set(std::string_view name);

// Typed lookups fall back to the declared default. A value that does not parse throws
// InvalidArgument naming the variable and the value.
std::string get_string(std::string_view name);
int64_t get_int(std::string_view name);
bool get_bool(std::string_view name);
// Sizes accept K, M, G suffixes (powers of 1024).
uint64_t get_size(std::string_view name);
// Seconds as a double (fractions allowed); 0 means "no limit" where the meaning says so.
double get_seconds(std::string_view name);

uint64_t parse_size(std::string_view text);  // throws InvalidArgument
// The non-empty parts of a list-valued variable (paths separated by ':', faults by ',').
std::vector<std::string> split_list(std::string_view text, char sep);

// The first set variable among names that belong to other launchers (OMPI_COMM_WORLD_RANK,
// SLURM_PROCID...). They are not tutti's and are documented with the TUTTI_* variable they stand in for.
std::optional<std::string> first_of(std::initializer_list<const char*> foreign_names);

}  // namespace tutti::env
